"""The contiguous step after loads of optimizer state it did not lay out itself.

The stepper shares one step counter among the parameters of a run. A state dict can carry
counters shared along other lines (rank 0's runs, pickled by torch's
``set_optimizer_state_dict(broadcast_from_rank0=True)``, arrive on a rank whose runs are cut
elsewhere), and one written by the stepper must load into torch's per-parameter loop, where
a counter shared by several parameters would be counted once per parameter.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from hooks_models import Block, local_slice, loss_fn, make_batches, make_model, trainable
from torch.distributed.tensor import DTensor

from mfsdp_collectives.testing import run_distributed
from mfsdp_hooks import FSDPRootWrapper, ShardingOptions, attach_optimizer


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _assert_same(a: torch.optim.Optimizer, b: torch.optim.Optimizer, where: str) -> None:
    params_a = [p for g in a.param_groups for p in g["params"]]
    params_b = [p for g in b.param_groups for p in g["params"]]
    for index, (pa, pb) in enumerate(zip(params_a, params_b, strict=True)):
        assert torch.equal(_local(pa), _local(pb)), f"{where}: weight {index} differs"
        for key, value in a.state.get(pa, {}).items():
            other = b.state[pb][key]
            assert torch.equal(_local(value), _local(other)), f"{where}: {key} of {index}"


def _pair(contiguous: tuple[bool, bool]) -> tuple[list[torch.nn.Module], list[Any]]:
    options = ShardingOptions(sync_model_each_microbatch=False)
    models = [
        FSDPRootWrapper(make_model(), fsdp_unit_modules=[Block], options=options) for _ in range(2)
    ]
    optimizers = [
        attach_optimizer(
            torch.optim.AdamW(trainable(model), lr=1e-2), contiguous_step=flag, step_chunk_numel=13
        )
        for model, flag in zip(models, contiguous, strict=True)
    ]
    return models, optimizers


def _train(models: list[Any], optimizers: list[Any], batches: list[Any], rank: int) -> None:
    for tokens, targets in batches:
        local = local_slice(tokens, rank, 2), local_slice(targets, rank, 2)
        for model, optimizer in zip(models, optimizers, strict=True):
            loss_fn(model(local[0]), local[1]).backward()
            optimizer.step()
            optimizer.zero_grad()


def _shared_counter_worker(rank: int, world: int) -> None:
    batches = make_batches(5, 8)
    models, (per_param, contiguous) = _pair((False, True))
    _train(models, [per_param, contiguous], batches[:2], rank)
    # Every parameter's counter one tensor, as a state dict pickled from runs cut
    # differently arrives: the contiguous step must count each of its runs once.
    saved = copy.deepcopy(contiguous.state_dict())
    shared = torch.tensor(2.0)
    for entry in saved["state"].values():
        entry["step"] = shared
    contiguous.load_state_dict(saved)
    _train(models, [per_param, contiguous], batches[2:], rank)
    _assert_same(per_param, contiguous, "after loading shared counters")
    assert float(shared) == 2.0, "the loaded state dict's tensor was stepped"


def test_contiguous_step_counts_each_run_once_after_loading_shared_counters() -> None:
    run_distributed(_shared_counter_worker, 2, timeout=120)


def _into_torch_loop_worker(rank: int, world: int) -> None:
    batches = make_batches(5, 8)
    models, optimizers = _pair((True, True))
    _train(models, optimizers, batches[:2], rank)
    # The stepper's state dict, copied as torch.save and pickling do (shared tensors stay
    # shared), into an optimizer that steps each parameter itself.
    saved = copy.deepcopy(optimizers[0].state_dict())
    per_param = attach_optimizer(
        torch.optim.AdamW(trainable(models[1]), lr=1e-2), contiguous_step=False
    )
    with torch.no_grad():
        for a, b in zip(trainable(models[0]), trainable(models[1]), strict=True):
            _local(b).copy_(_local(a))
    per_param.load_state_dict(saved)
    _train(models, [optimizers[0], per_param], batches[2:], rank)
    _assert_same(optimizers[0], per_param, "torch's loop on the stepper's state dict")


def test_contiguous_step_state_dict_loads_into_torchs_per_parameter_loop() -> None:
    run_distributed(_into_torch_loop_worker, 2, timeout=120)
