"""Sharded training equals single-process training on the global batch, step for step."""

from __future__ import annotations

from functools import partial

import pytest
from hooks_models import Block, make_optimizer
from torch import nn

from mfsdp_collectives import disable_host_transport, host_transport_of
from mfsdp_hooks import FSDPRootWrapper, ShardingOptions, fsdp_units
from mfsdp_hooks.testing.parity import ParityCase, inner, run_parity, shard_blocks


def _root_wrapper(model: nn.Module, strategy: int, allocator: str, transport: str) -> nn.Module:
    wrapped = FSDPRootWrapper(
        model,
        fsdp_unit_modules=[Block],
        options=ShardingOptions(
            zero_dp_strategy=strategy,
            sync_model_each_microbatch=True,
            grad_buffer_allocator=allocator,
            host_transport=transport.replace("shm-then-gloo", "shm"),
        ),
    )
    shard_group = fsdp_units(model)[0].options.topology.shard_group
    assert (host_transport_of(shard_group) is None) == (transport == "gloo")
    return wrapped


def _back_to_gloo_halfway(model: nn.Module, step: int) -> None:
    """Units built for shared memory keep working when the group goes back to gloo."""
    if step == 5:
        disable_host_transport(fsdp_units(inner(model))[0].options.topology.shard_group)


def megatron_case(
    strategy: int, optimizer: str = "adamw", allocator: str = "plain", transport: str = "auto"
) -> ParityCase:
    """The toy model under ``FSDPRootWrapper`` (the blocks and the root its units)."""
    return ParityCase(
        f"strategy={strategy} {optimizer} {allocator} {transport}",
        partial(_root_wrapper, strategy=strategy, allocator=allocator, transport=transport),
        optimizer=partial(make_optimizer, optimizer),
        before_step=_back_to_gloo_halfway if transport == "shm-then-gloo" else None,
    )


def per_module_case(strategy: int) -> ParityCase:
    """The toy model under per-module ``fully_shard`` (each block, then the root)."""
    shard = partial(shard_blocks, sharding_strategy=strategy)
    return ParityCase(
        f"per_module strategy={strategy}", shard, optimizer=partial(make_optimizer, "adamw")
    )


@pytest.mark.parametrize("world", [2, 3, 4])  # 12 rows: divisible by 2, 3 and 4
def test_parity_every_strategy(world: int) -> None:
    run_parity(world, [megatron_case(s, o) for s in range(4) for o in ("adamw", "sgd")], 300)


def test_parity_per_module_api_and_pooled_gradient_buffers() -> None:
    pooled = [
        megatron_case(s, allocator=a) for a in ("double_buffer", "trace_pool") for s in (0, 3)
    ]
    run_parity(2, [per_module_case(0), per_module_case(3), *pooled])


@pytest.mark.parametrize("world", [2, 4])
def test_parity_through_gloo_and_through_shared_memory(world: int) -> None:
    """The tests above run on the default transport (shared memory on one host); this keeps
    gloo's own collectives at parity too, and pins that the choice is the one taken."""
    cases = [
        megatron_case(3, transport="gloo"),
        megatron_case(2, transport="shm"),
        megatron_case(3, transport="shm-then-gloo"),
    ]
    run_parity(world, cases)
