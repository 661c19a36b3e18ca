"""The seed's entry points, then a forward whose output is thrown away (a shape probe, with
autograd on), then a fresh optimizer on ``model.parameters()``.

The root keeps its gathered weights in the model from such a forward until its backward (as
FSDP2's), so that optimizer held the compute copies of the root's weights and stepped nothing
the model reads: parity diverged at step 1 (4.464 vs 4.338). Handed over with
``fully_shard_optimizer`` it is re-pointed at the sharded parameters and trains as one
process; a bare one is refused at its step on every rank. The per-module ``fully_shard`` and
``reshard_after_forward=False`` are tested in mfsdp-hooks."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

import megatron_fsdp
from megatron_fsdp import DistributedDataParallelConfig, FSDPDistributedIndex, MegatronFSDP
from mfsdp_collectives.testing import run_distributed
from mfsdp_hooks import dist_param_of
from mfsdp_hooks.testing import Block, loss_fn, make_batches, make_model
from mfsdp_hooks.testing.parity import ParityCase, adamw, check_parity, full_weights, trainable


def _probe(model: nn.Module) -> nn.Module:
    model(make_batches(1, seed=7)[0][0][:6])
    assert any(dist_param_of(p) is not p for p in trainable(model))  # the root's, until backward
    return model


def _seed_one_liner(model: nn.Module) -> nn.Module:
    wrapped, optimizer = megatron_fsdp.fully_shard(
        model, adamw(model.parameters()), fsdp_unit_modules=[Block]
    )
    _probe(wrapped)
    # Its own optimizer was re-pointed before the probe.
    assert all(dist_param_of(p) is p for g in optimizer.param_groups for p in g["params"])
    return wrapped


def _model_only(model: nn.Module) -> nn.Module:
    return _probe(megatron_fsdp.fully_shard_model(model, fsdp_unit_modules=[Block]))


def _class(model: nn.Module) -> nn.Module:
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp_shard",))
    index = FSDPDistributedIndex(mesh, dp_shard_dim="dp_shard")
    config = DistributedDataParallelConfig(data_parallel_sharding_strategy="optim_grads_params")
    return _probe(MegatronFSDP(model, index, config, fsdp_unit_modules=[Block]))


def _probed_then_fresh_optimizer(rank: int, world: int) -> None:
    for shard in (_seed_one_liner, _model_only, _class):
        label = f"{shard.__name__} + fully_shard_optimizer"
        handed_over = megatron_fsdp.fully_shard_optimizer
        check_parity(rank, world, ParityCase(label, shard, sharded_optimizer=handed_over, steps=3))
        _bare_refused(rank, world, shard)


def _bare_refused(rank: int, world: int, shard: Callable[[nn.Module], nn.Module]) -> None:
    model = shard(make_model())
    optimizer = adamw(trainable(model))  # a fresh, bare one: never handed over
    tokens, targets = make_batches(1)[0]
    loss_fn(model(tokens.chunk(world)[rank]), targets.chunk(world)[rank]).backward()
    before = full_weights(model)
    with pytest.raises(RuntimeError, match=r"gathered compute weights \(group 0, position 0"):
        optimizer.step()
    after = full_weights(model)
    assert all(torch.equal(before[n], after[n]) for n in before), shard.__name__


def test_a_fresh_optimizer_after_a_forward_without_backward_trains_or_is_refused() -> None:
    run_distributed(_probed_then_fresh_optimizer, 2, timeout=120)
