"""A forward whose backward never comes (a shape probe, an evaluation), then an optimizer
built on ``model.parameters()``: it trains every weight, or its step refuses.

A unit that keeps its gathered weights after forward (the root by default; any unit with
``reshard_after_forward=False``) showed them in its modules until a backward that never came,
so an optimizer built then stepped those compute copies, which nothing reads: the weights
silently never trained (FSDP2 does the same). Under ``torch.no_grad()`` the modules now show
the sharded parameters at once; with autograd on they show the gathered ones until the
backward (as FSDP2, whose chunked-loss patterns read them), and an optimizer built on them
is refused at its step.
"""

from __future__ import annotations

import pytest
import torch
from hooks_models import Block, loss_fn, make_batches, make_model
from torch import nn

from mfsdp_collectives.testing import run_distributed
from mfsdp_hooks import FSDPRootWrapper, ShardingOptions, attach_optimizer, dist_param_of
from mfsdp_hooks.testing.parity import ParityCase, full_weights, run_parity, shard_blocks, trainable


def _gathered(model: nn.Module) -> list[nn.Parameter]:
    """The model's parameters that are gathered compute weights, not the sharded ones."""
    return [p for p in trainable(model) if dist_param_of(p) is not p]


def _probe(model: nn.Module, grad: bool) -> nn.Module:
    """One forward of ``model``, its output thrown away."""
    with torch.set_grad_enabled(grad):
        model(make_batches(1, seed=7)[0][0][:6])
    return model


def _kept_without_grad(model: nn.Module) -> nn.Module:
    model = _probe(shard_blocks(model, reshard_after_forward=False), grad=False)
    assert not _gathered(model), "gathered weights left in the model after a no_grad forward"
    return model


def test_an_optimizer_built_after_a_no_grad_forward_trains_every_weight() -> None:
    run_parity(2, [ParityCase("reshard_after_forward=False", _kept_without_grad, steps=3)])


def _built_after_grad_probe(rank: int, world: int) -> None:
    for wrap in ["per-module", "root wrapper ZeRO-2"]:
        _refused_at_step(rank, world, wrap)


def _refused_at_step(rank: int, world: int, wrap: str) -> None:
    model = make_model()
    if wrap == "per-module":
        shard_blocks(model)
    else:
        model = FSDPRootWrapper(
            model, fsdp_unit_modules=[Block], options=ShardingOptions(zero_dp_strategy=2)
        )
    _probe(model, grad=True)
    assert _gathered(model), "the root shows its gathered weights until a backward"
    with pytest.raises(ValueError, match="gathered compute weights"):
        attach_optimizer(torch.optim.AdamW(trainable(model), lr=1e-2))
    optimizer = torch.optim.AdamW(trainable(model), lr=1e-2)
    tokens, targets = make_batches(1)[0]
    loss_fn(model(tokens.chunk(world)[rank]), targets.chunk(world)[rank]).backward()
    before = full_weights(model)
    with pytest.raises(RuntimeError, match=r"gathered compute weights \(group 0, position 0: "):
        optimizer.step()
    after = full_weights(model)
    assert all(torch.equal(before[name], after[name]) for name in before), wrap


def test_an_optimizer_built_on_gathered_weights_is_refused_at_its_step() -> None:
    run_distributed(_built_after_grad_probe, 2, timeout=120)
