"""An optimizer whose update is not element-wise (torch's Muon) is refused over shards.

On a shard torch's Muon orthogonalises the wrong matrix and trains something else without a
word (FSDP2 as well). Built on the sharded model's parameters and never handed over, it is
refused on every rank at the first forward, naming our exact ``megatron_fsdp.Muon``, while
element-wise optimizers keep training, even with the refused optimizer still alive; handed
over, it becomes ours (``test_megatron_fsdp_muon.py``). With nothing sharded
(``zero_dp_strategy=0``) torch's Muon is exact and trains as one process.
"""

from __future__ import annotations

import os
from typing import Any, cast

import pytest
import torch
from torch import nn
from torch.distributed.tensor import DTensor
from toy_entry_points import shard_toy

import megatron_fsdp
from mfsdp_collectives.testing import run_distributed
from mfsdp_hooks.testing import (
    local_slice,
    make_batches,
    make_model,
    train_data_parallel,
    train_single_process,
)

# The entry points whose optimizer the engine finds at the first forward (one handed over
# is routed to ours); CI keeps two, the full run adds the class.
_FULL_ONLY = pytest.mark.skipif(
    os.environ.get("MFSDP_FULL_MATRIX") != "1", reason="MFSDP_FULL_MATRIX=1 only"
)
ENTRY_POINTS = ["per_module", "mcore", pytest.param("class", marks=_FULL_ONLY)]
LR = 1e-2


def _muon(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.Muon([p for p in model.parameters() if p.ndim == 2], lr=LR)


def _sgd(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)


def _train(
    entry: str, rank: int, world: int, build: Any, steps: int
) -> tuple[nn.Module, torch.optim.Optimizer]:
    """Shard through ``entry``, the optimizer left for the engine to find (``seed``: handed
    to ``fully_shard``), and train ``steps`` steps (0: one forward only)."""
    wrapped, optimizer = shard_toy(entry, world, build, hand_over=False)
    batches = make_batches(max(steps, 1))
    if steps:
        train_data_parallel(wrapped, optimizer, batches, rank, world)
    else:
        wrapped(local_slice(batches[0][0], rank, world))
    return wrapped, optimizer


def _refused_then_sgd_trains(rank: int, world: int, entry: str) -> str:
    muon: list[torch.optim.Optimizer] = []  # kept alive while another model trains

    def build_muon(model: nn.Module) -> torch.optim.Optimizer:
        muon.append(_muon(model))
        return muon[-1]

    try:
        _train(entry, rank, world, build_muon, steps=0)
    except ValueError as error:
        message = str(error)
    else:
        return "accepted"
    assert muon, "the refusal came before the optimizer was built"
    _train(entry, rank, world, _sgd, steps=2)
    return message


@pytest.mark.parametrize("entry", ENTRY_POINTS)
def test_muon_is_refused_over_shards_and_sgd_trains(entry: str) -> None:
    messages = run_distributed(_refused_then_sgd_trains, 2, entry, timeout=120)
    assert messages[0] == messages[1], "every rank refuses alike"
    message = messages[0]
    assert "torch.optim.Muon" in message, message
    assert "orthogonalises" in message and "zero_dp_strategy=0" in message, message
    assert "use megatron_fsdp.Muon" in message and "becomes it" in message, message


def _muon_no_shard(rank: int, world: int) -> float:
    batches = make_batches(3)
    reference = make_model()
    train_single_process(reference, _muon(reference), batches)
    wrapped, optimizer = shard_toy("seed", world, _muon, zero_dp_strategy=0)
    train_data_parallel(wrapped, optimizer, batches, rank, world)
    mine = {n: cast(DTensor, p).full_tensor() for n, p in wrapped.module.named_parameters()}
    return max(
        float((mine[name] - param).abs().max())
        for name, param in reference.named_parameters()
        if name in mine
    )


def test_muon_trains_as_one_process_with_nothing_sharded() -> None:
    # Equal today (0.0); the bound leaves room for one bfloat16 rounding of Muon's update
    # (a gradient averaged over ranks may differ from one process's in its last bit).
    assert max(run_distributed(_muon_no_shard, 2, timeout=120)) < 1e-4


class _MyElementwise(torch.optim.SGD):
    """A subclass may change ``step`` arbitrarily: refused until declared."""


def _declared(rank: int, world: int) -> list[str]:
    outcomes = []
    for _ in range(2):
        try:
            _train("seed", rank, world, lambda m: _MyElementwise(m.parameters(), lr=LR), steps=1)
            outcomes.append("accepted")
        except ValueError as error:
            outcomes.append(str(error))
        megatron_fsdp.declare_elementwise_optimizer(_MyElementwise)
    return outcomes


def test_a_subclass_is_refused_until_declared_elementwise() -> None:
    refused, declared = run_distributed(_declared, 2)[0]
    assert "_MyElementwise" in refused, refused
    assert "nothing says its update is element-wise" in refused, refused
    assert declared == "accepted"


class _Wrapper(torch.optim.Optimizer):
    """accelerate's ``AcceleratedOptimizer`` in miniature (transformers' Trainer builds one):
    an optimizer that shares its param groups with the one it steps through."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer = optimizer

    @property  # type: ignore[override]
    def param_groups(self) -> list[dict[str, Any]]:
        return self.optimizer.param_groups

    def step(self, closure: Any = None) -> Any:
        return self.optimizer.step(closure)


def test_a_wrapper_is_judged_by_the_optimizer_it_steps_through() -> None:
    from mfsdp_hooks import is_elementwise_optimizer

    model = make_model()
    assert is_elementwise_optimizer(_Wrapper(_sgd(model)))
    assert not is_elementwise_optimizer(_Wrapper(_muon(model)))
    assert not is_elementwise_optimizer(_muon(model))
