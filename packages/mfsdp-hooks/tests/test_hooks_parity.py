"""Sharded training equals single-process training on the global batch, step for step."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from hooks_models import (
    Block,
    assert_close_rel,
    full_state,
    local_slice,
    loss_fn,
    make_batches,
    make_model,
    make_optimizer,
    reference_training,
)

from mfsdp_collectives import disable_host_transport, host_transport_of
from mfsdp_collectives.testing import run_distributed
from mfsdp_hooks import FSDPRootWrapper, ShardingOptions, fsdp_units, fully_shard

STEPS = 10
GLOBAL_BATCH = 12  # divisible by 2, 3 and 4


def _train_sharded(
    rank: int, world: int, strategy: int, optimizer_name: str, api: str
) -> tuple[list[float], dict[str, torch.Tensor]]:
    model = make_model()
    transport = ""
    if api == "per_module":
        for block in model.blocks:
            fully_shard(block, sharding_strategy=strategy)
        fully_shard(model, sharding_strategy=strategy)
        trained: torch.nn.Module = model
    else:
        _, allocator, transport = [*api.split(":"), "", ""][:3]
        trained = FSDPRootWrapper(
            model,
            fsdp_unit_modules=[Block],
            options=ShardingOptions(
                zero_dp_strategy=strategy,
                sync_model_each_microbatch=True,
                grad_buffer_allocator=allocator or "plain",
                host_transport=(transport or "auto").replace("shm-then-gloo", "shm"),
            ),
        )
        shard_group = fsdp_units(model)[0].options.topology.shard_group
        assert (host_transport_of(shard_group) is None) == (transport == "gloo")
    optimizer = make_optimizer(optimizer_name, [p for p in trained.parameters() if p.requires_grad])
    losses = []
    for step, (tokens, targets) in enumerate(make_batches(STEPS, GLOBAL_BATCH)):
        if transport == "shm-then-gloo" and step == STEPS // 2:
            # Units built for shared memory keep working when the group goes back to gloo.
            disable_host_transport(fsdp_units(model)[0].options.topology.shard_group)
        loss = loss_fn(trained(local_slice(tokens, rank, world)), local_slice(targets, rank, world))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        global_loss = loss.detach().clone()
        torch.distributed.all_reduce(global_loss)
        losses.append(global_loss.item() / world)
    return losses, full_state(model)


def _parity_worker(rank: int, world: int, configs: list[tuple[int, str, str]]) -> None:
    batches = make_batches(STEPS, GLOBAL_BATCH)
    references: dict[str, Any] = {}
    for strategy, optimizer_name, api in configs:
        if optimizer_name not in references:
            references[optimizer_name] = reference_training(optimizer_name, batches)
        ref_losses, ref_state = references[optimizer_name]
        losses, state = _train_sharded(rank, world, strategy, optimizer_name, api)
        label = f"strategy={strategy} {optimizer_name} {api} world={world}"
        for step, (got, want) in enumerate(zip(losses, ref_losses, strict=True)):
            assert abs(got - want) <= 1e-5 * abs(want), f"{label} step {step}: {got} vs {want}"
        assert state.keys() == ref_state.keys()
        for name, value in ref_state.items():
            assert_close_rel(state[name], value, 1e-5, f"{label} {name}")


@pytest.mark.parametrize("world", [2, 3, 4])
@pytest.mark.parametrize("strategy", [0, 1, 2, 3])
def test_parity_every_strategy(world: int, strategy: int) -> None:
    configs = [(strategy, "adamw", "megatron"), (strategy, "sgd", "megatron")]
    run_distributed(_parity_worker, world, configs, timeout=240)


@pytest.mark.parametrize("strategy", [0, 3])
def test_parity_per_module_api(strategy: int) -> None:
    run_distributed(_parity_worker, 2, [(strategy, "adamw", "per_module")], timeout=240)


@pytest.mark.parametrize("allocator", ["double_buffer", "trace_pool"])
@pytest.mark.parametrize("strategy", [0, 3])
def test_parity_with_pooled_gradient_buffers(strategy: int, allocator: str) -> None:
    run_distributed(_parity_worker, 2, [(strategy, "adamw", f"megatron:{allocator}")], timeout=240)


@pytest.mark.parametrize("world", [2, 4])
def test_parity_through_gloo_and_through_shared_memory(world: int) -> None:
    """The tests above run on the default transport (shared memory on one host); this keeps
    gloo's own collectives at parity too, and pins that the choice is the one taken."""
    configs = [
        (3, "adamw", "megatron::gloo"),
        (2, "adamw", "megatron::shm"),
        (3, "adamw", "megatron::shm-then-gloo"),
    ]
    run_distributed(_parity_worker, world, configs, timeout=240)
