"""Host offload with the tools users bring: peft's LoRA, ``torch.compile`` per block, and
torch's state-dict helpers and plain DCP (``ecosystem_cases``), through the per-module
``fully_shard(offload_policy=CPUOffloadPolicy())`` and the seed one-liner
``megatron_fsdp.fully_shard(model, optimizer, optimizer_cpu_offload=True)``.

On CPU with the host copies forced (``mfsdp_hooks.testing.offload``): each cell trains 10
AdamW steps on 2 ranks and matches one process on the global batch (every step's loss and
the final full weights within 1e-5); the round trips save after 5 steps, load into a fresh
offloaded model and optimizer drawn from another seed, and train the other 5.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import ecosystem_cases
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import CPUOffloadPolicy
from torch.distributed.tensor import DTensor

import megatron_fsdp
import mfsdp_hooks
from mfsdp_collectives.testing import run_distributed
from mfsdp_hooks.testing import Block, assert_close_rel, loss_fn, make_batches, make_model
from mfsdp_hooks.testing.offload import forced_host_copies, offload_counts, offloads
from mfsdp_hooks.testing.parity import adamw, full_weights, trainable
from mfsdp_hooks.testing.plain_dcp import DCPBlock, check_plain_dcp_resume

STEPS, SAVE_AFTER, RTOL = 10, 5, 1e-5
ENTRIES = ("per_module", "seed")
Pair = tuple[nn.Module, torch.optim.Optimizer]


def _model(cell: str, seed: int) -> nn.Module:
    return ecosystem_cases.model("lora", seed) if cell == "lora" else make_model(seed)


def _wrap(entry: str, model: nn.Module, unit: type[nn.Module] = Block) -> Pair:
    """``model`` offloaded through ``entry`` (its ``unit`` blocks one unit each), its AdamW."""
    with forced_host_copies():
        if entry == "seed":
            wrapped, optimizer = megatron_fsdp.fully_shard(
                model, adamw(trainable(model)), fsdp_unit_modules=[unit], optimizer_cpu_offload=True
            )
        else:
            policy = CPUOffloadPolicy(pin_memory=True)
            for block in [m for m in model.modules() if isinstance(m, unit)]:
                mfsdp_hooks.fully_shard(block, offload_policy=policy)
            wrapped = mfsdp_hooks.fully_shard(model, offload_policy=policy)
            optimizer = adamw(trainable(wrapped))
    assert len(offloads(wrapped)) == len(mfsdp_hooks.fsdp_units(wrapped)) > 1, "not offloaded"
    return wrapped, optimizer


def _step(model: nn.Module, optimizer: torch.optim.Optimizer, batch: Any, share: int) -> float:
    """One step on this rank's ``share`` of the global ``batch``; the global loss."""
    tokens, targets = (t.chunk(dist.get_world_size())[share] for t in batch)
    loss = loss_fn(model(tokens), targets)
    loss.backward()  # type: ignore[no-untyped-call]
    optimizer.step()
    optimizer.zero_grad()
    total = loss.detach().clone()
    dist.all_reduce(total)
    return total.item() / dist.get_world_size()


def _reference(cell: str) -> tuple[list[float], dict[str, torch.Tensor]]:
    model = _model(cell, 0)
    optimizer = adamw(trainable(model))
    losses = []
    for tokens, targets in make_batches(STEPS):
        loss = loss_fn(model(tokens), targets)
        loss.backward()  # type: ignore[no-untyped-call]
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses, full_weights(model)


def _train(entry: str, cell: str, rank: int, ckpt: str) -> tuple[list[float], nn.Module]:
    """The cell sharded: 10 steps, the state taken out and put into a fresh pair after 5
    for a round trip, every block compiled for ``compile_block``."""
    model, optimizer = _wrap(entry, _model(cell, 0))
    called, counter = ecosystem_cases.compiled(cell, model, Block)
    losses = []
    for step, batch in enumerate(make_batches(STEPS)):
        if cell in ecosystem_cases.ROUND_TRIPS and step == SAVE_AFTER:
            load = ecosystem_cases.round_trip(cell, model, optimizer, ckpt)
            model, optimizer = _wrap(entry, _model(cell, 123))  # the load must win
            load(model, optimizer)
            called = model
        losses.append(_step(called, optimizer, batch, rank))
    assert counter is None or counter.graphs > 0, f"{entry} x {cell}: compiled nothing"
    _assert_steps_the_host_shards(model, optimizer, f"{entry} x {cell}", lora=cell == "lora")
    return losses, model


def _assert_steps_the_host_shards(
    model: nn.Module, optimizer: torch.optim.Optimizer, what: str, *, lora: bool
) -> None:
    """Every group offloaded, the optimizer stepping its host shards (after a load too), and
    its reduced gradients copied home; with LoRA, each block's unit holds a frozen group
    beside a trainable one."""
    stepped = {id(p) for group in optimizer.param_groups for p in group["params"]}
    for unit in mfsdp_hooks.fsdp_units(model):
        for group in unit.groups:
            assert group.offload is not None and group.main is not None, what
            host = group.main.shard.untyped_storage().data_ptr()
            for param in group.dist_params:
                assert isinstance(param, DTensor), what
                assert param.to_local().untyped_storage().data_ptr() == host, what
                assert (id(param) in stepped) == group.requires_grad, what
    if lora:
        blocks = mfsdp_hooks.fsdp_units(model)[1:]
        assert all({g.requires_grad for g in u.groups} == {True, False} for u in blocks), what
    assert offload_counts(model).to_host > 0, f"{what}: no gradient came home"


def _worker(rank: int, world: int, cells: list[str], ckpt: str) -> int:
    """Each cell through each entry point against one process; then, for the round trips,
    plain DCP of ``optimizer.state_dict()`` (``check_plain_dcp_resume``). Returns the most
    empty local pieces a plain-DCP model had on this rank."""
    for cell in cells:
        want_losses, want_weights = _reference(cell)
        for entry in ENTRIES:
            what = f"{entry} x {cell}"
            losses, model = _train(entry, cell, rank, f"{ckpt}/{entry}-{cell}")
            for step, (got, want) in enumerate(zip(losses, want_losses, strict=True)):
                assert abs(got - want) <= RTOL * abs(want), f"{what} step {step}: {got} vs {want}"
            got_weights = full_weights(model)
            assert got_weights.keys() == want_weights.keys(), what
            for name, value in want_weights.items():
                assert_close_rel(got_weights[name], value, RTOL, f"{what}: {name}")
    if "dcp_plain" not in cells:
        return 0
    # FSDP2's script: dcp.save/load of model.state_dict() and optimizer.state_dict(), the
    # model resumed by dcp.load alone (in place, into the host shards) or by load_state_dict
    # after it; the units split mid-parameter (an empty piece on one rank).
    empties = []
    for entry, then_load in (("per_module", False), ("seed", True)):
        empties.append(
            check_plain_dcp_resume(
                rank,
                world,
                f"{ckpt}/plain-{entry}",
                functools.partial(_wrap, entry, unit=DCPBlock),
                model_load_state_dict=then_load,
                init_state=entry != "seed",  # the seed's enable_dcp gives placeholders
            )
        )
    return max(empties)


def test_offload_with_lora_and_compiled_blocks_trains_as_one_process(tmp_path: Path) -> None:
    run_distributed(_worker, 2, ["lora", "compile_block"], str(tmp_path), timeout=240)


def test_offload_round_trips_through_torch_state_dicts_and_plain_dcp(tmp_path: Path) -> None:
    cells = list(ecosystem_cases.ROUND_TRIPS)
    empties = run_distributed(_worker, 2, cells, str(tmp_path), timeout=240)
    assert max(empties) > 0, "no rank held an empty piece: the uneven split is not covered"
