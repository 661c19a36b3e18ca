"""Hybrid sharding (HSDP): sharded inside ``dp_shard``, replicated across ``dp_outer``.

Four gloo ranks as 2x2, 4x1 and 1x4 meshes train exactly as one process on the global
batch; the gradient of every micro-batch is reduce-scattered inside the shard group and
its shard all-reduced across the replicas exactly once, which the comm tracer counts.
"""

from __future__ import annotations

from functools import partial

import pytest
import torch.distributed as dist
from hooks_models import (
    Block,
    full_state,
    local_slice,
    loss_fn,
    make_batches,
    make_model,
    make_optimizer,
    shard_blocks,
    trainable,
)
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

from mfsdp_collectives import CommTracer
from mfsdp_collectives.testing import run_distributed
from mfsdp_hooks import FSDPRootWrapper, ShardingOptions, fsdp_units
from mfsdp_hooks.testing.parity import ParityCase, run_parity

GLOBAL_BATCH = 8
MICRO = 2


def _mesh(outer: int, shard: int):  # type: ignore[no-untyped-def]
    return init_device_mesh("cpu", (outer, shard), mesh_dim_names=("dp_outer", "dp_shard"))


def _hsdp(model: nn.Module, outer: int, strategy: int, api: str) -> nn.Module:
    mesh = _mesh(outer, dist.get_world_size() // outer)
    if api == "per_module":
        return shard_blocks(model, mesh=mesh, sharding_strategy=strategy)
    options = ShardingOptions(
        zero_dp_strategy=strategy, device_mesh=mesh, sync_model_each_microbatch=False
    )
    return FSDPRootWrapper(model, fsdp_unit_modules=[Block], options=options)


def hsdp_case(outer: int, strategy: int, api: str = "megatron", accumulate: str = "") -> ParityCase:
    """HSDP on an ``(outer, world / outer)`` mesh. ``accumulate``: "" (one micro-batch per
    step), "no_sync" (all but the last micro-batch under no_sync) or "finish" (all under
    no_sync, then finish_grad_sync)."""
    micro = MICRO if accumulate else 1
    return ParityCase(
        f"{outer}x(world/{outer}) strategy={strategy} {api} accumulate={accumulate}",
        partial(_hsdp, outer=outer, strategy=strategy, api=api),
        optimizer=partial(make_optimizer, "adamw"),
        batches=partial(make_batches, global_batch=GLOBAL_BATCH * micro),
        micro=micro,
        finish=accumulate == "finish",
        weights=full_state,
    )


def test_hsdp_parity_on_a_2x2_mesh() -> None:
    run_parity(4, [hsdp_case(2, strategy) for strategy in range(4)])


def test_hsdp_parity_on_the_edge_meshes_and_with_the_per_module_api() -> None:
    run_parity(4, [hsdp_case(4, 3), hsdp_case(1, 3), hsdp_case(2, 3, "per_module")])


def test_hsdp_parity_with_gradient_accumulation() -> None:
    cases = [
        hsdp_case(2, 1, "megatron", "no_sync"),
        hsdp_case(2, 3, "megatron", "no_sync"),
        hsdp_case(2, 2, "megatron", "finish"),
        hsdp_case(2, 3, "megatron", "finish"),
        hsdp_case(2, 3, "per_module", "no_sync"),  # fully_shard syncs every micro-batch by default
    ]
    run_parity(4, cases)


def _outer_once_per_cycle_worker(rank: int, world: int, mode: str) -> list[tuple[int, ...]]:
    options = ShardingOptions(device_mesh=_mesh(2, 2), sync_model_each_microbatch=False)
    model = FSDPRootWrapper(make_model(), fsdp_unit_modules=[Block], options=options)
    optimizer = make_optimizer("sgd", trainable(model))
    micro = 3
    counts = []
    for step, (tokens, targets) in enumerate(make_batches(2 * micro, GLOBAL_BATCH)):
        local = local_slice(tokens, rank, world), local_slice(targets, rank, world)
        if step % micro == 0:
            tracer = CommTracer().__enter__()
        last = step % micro == micro - 1
        if last and mode == "no_sync":
            loss_fn(model(local[0]), local[1]).backward()
        else:
            with model.no_sync():
                loss_fn(model(local[0]), local[1]).backward()
        if last:
            if mode == "finish":
                model.finish_grad_sync()
            tracer.__exit__(None, None, None)
            calls = (tracer.calls(op) for op in ("reduce_scatter", "all_reduce", "grad_presence"))
            counts.append(tuple(calls))
            optimizer.step()
            optimizer.zero_grad()
    return counts


@pytest.mark.parametrize("mode", ["no_sync", "finish"])
def test_hsdp_reduces_across_replicas_once_per_cycle(mode: str) -> None:
    # ZeRO-3, 4 trainable groups, 3 micro-batches: every micro-batch reduce-scatters inside
    # dp_shard (12), the shards cross dp_outer once per cycle (4), never per micro-batch; the
    # cycle's one agreement on which parameters got a gradient anywhere (grad_presence) is an
    # all-reduce in dp_shard and one across dp_outer (2).
    counts = run_distributed(_outer_once_per_cycle_worker, 4, mode, timeout=120)
    assert counts == [[(12, 4, 2), (12, 4, 2)]] * 4


def _hsdp_bytes_worker(rank: int, world: int) -> tuple[dict[str, dict[str, int]], list[int], int]:
    mesh = _mesh(2, 2)
    model = FSDPRootWrapper(
        make_model(),
        fsdp_unit_modules=[Block],
        options=ShardingOptions(device_mesh=mesh, sync_model_each_microbatch=False),
    )
    tokens, targets = make_batches(1, GLOBAL_BATCH)[0]
    local = local_slice(tokens, rank, world), local_slice(targets, rank, world)
    loss_fn(model(local[0]), local[1]).backward()  # warm-up: the prefetch order is recorded
    with CommTracer() as tracer:
        loss_fn(model(local[0]), local[1]).backward()
    groups = [g for unit in fsdp_units(model.module) for g in unit.groups if g.requires_grad]
    params = sum(len(g.dist_params) for g in groups)
    return tracer.summary(), [g.layout.padded_numel for g in groups], params


def test_hsdp_reduces_inside_the_shard_group_then_the_shard_across_replicas() -> None:
    for summary, padded, params in run_distributed(_hsdp_bytes_worker, 4, timeout=120):
        # fp32 gradients: the whole padded buffer reduce-scattered in dp_shard (2 ranks),
        # then each rank's half all-reduced across dp_outer, once per trainable group; and
        # the backward's one agreement on which parameters got a gradient anywhere
        # (grad_presence: a float per parameter, in dp_shard, then across dp_outer).
        assert summary["dp_shard/reduce_scatter"] == {
            "calls": len(padded),
            "bytes": 4 * sum(padded),
        }
        assert summary["dp_outer/all_reduce"] == {
            "calls": len(padded),
            "bytes": 4 * sum(padded) // 2,
        }
        for group in ("dp_shard", "dp_outer"):
            assert summary[f"{group}/grad_presence"] == {"calls": 1, "bytes": 4 * params}
