"""Hybrid sharding (HSDP): sharded inside ``dp_shard``, replicated across ``dp_outer``.

Four gloo ranks as 2x2, 4x1 and 1x4 meshes train exactly as one process on the global
batch; the gradient of every micro-batch is reduce-scattered inside the shard group and
its shard all-reduced across the replicas exactly once, which the comm tracer counts.
"""

from __future__ import annotations

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
    trainable,
)
from torch.distributed.device_mesh import init_device_mesh

from mfsdp_collectives import CommTracer
from mfsdp_collectives.testing import run_distributed
from mfsdp_hooks import FSDPRootWrapper, ShardingOptions, fsdp_units, fully_shard

STEPS = 10
GLOBAL_BATCH = 8
MICRO = 2


def _mesh(outer: int, shard: int):  # type: ignore[no-untyped-def]
    return init_device_mesh("cpu", (outer, shard), mesh_dim_names=("dp_outer", "dp_shard"))


def _hsdp_parity_worker(
    rank: int, world: int, outer: int, strategy: int, api: str, accumulate: str
) -> None:
    """``accumulate``: "" (one micro-batch per step), "no_sync" (all but the last micro-batch
    under no_sync) or "finish" (all under no_sync, then finish_grad_sync)."""
    micro = MICRO if accumulate else 1
    batches = make_batches(STEPS * micro, GLOBAL_BATCH)
    reference = make_model()
    ref_opt = make_optimizer("adamw", trainable(reference))
    mesh = _mesh(outer, world // outer)
    if api == "per_module":
        model = make_model()
        for block in model.blocks:
            fully_shard(block, mesh=mesh, sharding_strategy=strategy)
        wrapped: torch.nn.Module = fully_shard(model, mesh=mesh, sharding_strategy=strategy)
    else:
        options = ShardingOptions(
            zero_dp_strategy=strategy, device_mesh=mesh, sync_model_each_microbatch=False
        )
        wrapped = FSDPRootWrapper(make_model(), fsdp_unit_modules=[Block], options=options)
    optimizer = make_optimizer("adamw", trainable(wrapped))
    for step in range(STEPS):
        for index in range(micro):
            tokens, targets = batches[step * micro + index]
            (loss_fn(reference(tokens), targets) / micro).backward()
            local = local_slice(tokens, rank, world), local_slice(targets, rank, world)
            loss = loss_fn(wrapped(local[0]), local[1]) / micro
            if accumulate == "finish" or (accumulate and index < micro - 1):
                with wrapped.no_sync():  # type: ignore[operator]
                    loss.backward()
            else:
                loss.backward()
        if accumulate == "finish":
            wrapped.finish_grad_sync()  # type: ignore[operator]
        ref_opt.step()
        ref_opt.zero_grad()
        optimizer.step()
        optimizer.zero_grad()
    state = full_state(wrapped.module if isinstance(wrapped, FSDPRootWrapper) else wrapped)
    label = f"{outer}x{world // outer} strategy={strategy} {api} accumulate={accumulate}"
    for name, value in reference.state_dict().items():
        assert_close_rel(state[name], value, 1e-5, f"{label} {name}")


@pytest.mark.parametrize("strategy", [0, 1, 2, 3])
def test_hsdp_parity_on_a_2x2_mesh(strategy: int) -> None:
    run_distributed(_hsdp_parity_worker, 4, 2, strategy, "megatron", "", timeout=240)


@pytest.mark.parametrize("outer", [4, 1])
def test_hsdp_parity_on_the_edge_meshes(outer: int) -> None:
    run_distributed(_hsdp_parity_worker, 4, outer, 3, "megatron", "", timeout=240)


def test_hsdp_parity_with_the_per_module_api_on_a_2d_mesh() -> None:
    run_distributed(_hsdp_parity_worker, 4, 2, 3, "per_module", "", timeout=240)


@pytest.mark.parametrize(
    ("strategy", "api", "mode"),
    [
        (1, "megatron", "no_sync"),
        (3, "megatron", "no_sync"),
        (2, "megatron", "finish"),
        (3, "megatron", "finish"),
        (3, "per_module", "no_sync"),  # fully_shard syncs every micro-batch by default
    ],
)
def test_hsdp_parity_with_gradient_accumulation(strategy: int, api: str, mode: str) -> None:
    run_distributed(_hsdp_parity_worker, 4, 2, strategy, api, mode, timeout=240)


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
