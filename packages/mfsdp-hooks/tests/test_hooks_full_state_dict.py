"""torch's ``set_model_state_dict`` / ``set_optimizer_state_dict`` with FULL state dicts.

FSDP2 scripts load a full checkpoint two ways: rank 0 holds it and broadcasts
(``broadcast_from_rank0=True``, torchtitan's way), or every rank holds it. torch then cuts
each full tensor for a DTensor parameter by its placements (``torch.chunk`` rows), which is
not the flat layout's row ranges: the units here split a 32x32 weight 17/15 over 2 ranks
(not 16/16) and give one rank none of a bias. Loaded weights and a continued run must be
those of an uninterrupted one.
"""

from __future__ import annotations

import copy
from unittest import mock

import pytest
import torch
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from mfsdp_collectives.testing import run_distributed
from mfsdp_hooks import RowShardedDTensor
from mfsdp_hooks.dtensor import load_rows
from mfsdp_hooks.testing import plain_dcp
from mfsdp_hooks.testing.parity import shard_blocks

SAVE_AT, MORE = plain_dcp.SAVE_AT, 2


def _wrap(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    model = plain_dcp._model(seed)
    shard_blocks(model)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)


def _worker(rank: int, world: int, broadcast: bool, forward_first: bool = False) -> None:
    """``forward_first``: the fresh model runs a forward before the loads (its optimizer is
    then found, and its loaded state laid out, by a load hook, not by the first forward)."""
    batches = plain_dcp._batches(world, rank)
    straight, straight_opt = _wrap(0)
    plain_dcp._train(straight, straight_opt, batches[: SAVE_AT + MORE])
    want = plain_dcp._full_weights(straight)

    model, optimizer = _wrap(0)
    plain_dcp._train(model, optimizer, batches[:SAVE_AT])
    saved = plain_dcp._full_weights(model)
    out = StateDictOptions(full_state_dict=True, cpu_offload=broadcast)
    model_sd = get_model_state_dict(model, options=out)
    optim_sd = copy.deepcopy(get_optimizer_state_dict(model, optimizer, options=out))
    if broadcast:
        assert rank == 0 or not model_sd, "cpu_offload: only rank 0 holds the full state"

    fresh, fresh_opt = _wrap(1)  # another init: only the load can make it right
    if forward_first:
        with torch.no_grad():
            fresh(batches[0][0])
    into = StateDictOptions(full_state_dict=True, broadcast_from_rank0=broadcast)
    set_model_state_dict(fresh, model_sd, options=into)
    for name, value in plain_dcp._full_weights(fresh).items():
        plain_dcp._assert_close(value, saved[name], f"{name} right after the load")
    set_optimizer_state_dict(fresh, fresh_opt, optim_sd, options=into)
    plain_dcp._train(fresh, fresh_opt, batches[SAVE_AT : SAVE_AT + MORE])
    for name, value in plain_dcp._full_weights(fresh).items():
        plain_dcp._assert_close(value, want[name], f"{name} after {MORE} more steps")


@pytest.mark.parametrize(
    ("world", "broadcast", "forward_first"),
    [(2, True, False), (2, False, False), (2, False, True), (1, False, False)],
    ids=["from_rank0", "on_every_rank", "on_every_rank_after_a_forward", "one_rank"],
)
def test_full_state_dict_loads_our_rows(world: int, broadcast: bool, forward_first: bool) -> None:
    """on_every_rank failed before for the optimizer: torch's distribute_tensor gave a bare
    optimizer torch.chunk pieces ('The size of tensor a (16) must match the size of tensor b
    (15)' at the step). one_rank: the rows are torch.chunk's (TorchChunkRowsDTensor), and
    the optimizer's state plain DTensors."""
    run_distributed(_worker, world, broadcast, forward_first, timeout=120)


def _convert_once_worker(rank: int, world: int) -> int:
    model, _ = _wrap(1)
    full = plain_dcp._model(0).state_dict()
    real, calls = load_rows.own_rows, 0

    def counted(value: torch.Tensor, param: RowShardedDTensor, key: str) -> torch.Tensor:
        nonlocal calls
        calls += 1
        return real(value, param, key)

    with mock.patch.object(load_rows, "own_rows", counted):
        model.load_state_dict(full)
    for name, value in plain_dcp._full_weights(model).items():
        plain_dcp._assert_close(value, full[name], f"{name} after load_state_dict")
    return calls


def test_load_state_dict_converts_each_value_once() -> None:
    """Units nest (each block in the root's module): each unit's pre-hook converts only its
    own parameters' values, not those of the units below it again."""
    calls = run_distributed(_convert_once_worker, 2, timeout=60)
    assert calls == [len(plain_dcp._model(0).state_dict())] * 2, calls
