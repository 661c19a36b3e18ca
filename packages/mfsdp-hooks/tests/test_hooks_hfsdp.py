"""HFSDP: ZeRO-3 inside ``dp_shard``, and main weights, gradients and optimizer state also
sharded across ``dp_outer``.

Four gloo ranks as 2x2, 4x1 and 1x4 meshes train exactly as one process on the global
batch. The comm tracer sees each gradient reduce-scattered inside the shard group, then its
shard reduce-scattered across the replicas once per optimisation cycle, and the updated
sub-shards all-gathered across the replicas once per cycle, never per micro-batch; each
rank's optimizer state is a 1/(outer x shard) sub-shard of the model.
"""

from __future__ import annotations

from functools import partial

import pytest
import torch
import torch.distributed as dist
from hooks_models import (
    Block,
    assert_close_rel,
    full_state,
    hfsdp_topology,
    local_slice,
    loss_fn,
    make_batches,
    make_model,
    make_optimizer,
    trainable,
)
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

from mfsdp_collectives import CommTracer, FSDPTopology
from mfsdp_collectives.testing import run_distributed
from mfsdp_hooks import (
    FSDPRootWrapper,
    MixedPrecisionPolicy,
    ShardingOptions,
    attach_optimizer,
    fsdp_units,
)
from mfsdp_hooks.testing.parity import ParityCase, run_parity

STEPS = 10
GLOBAL_BATCH = 8
MICRO = 2


def _hfsdp(model: nn.Module, outer: int, sync_each: bool, transport: str) -> nn.Module:
    """``transport``: both levels on shared memory ("auto", on one host) or on gloo."""
    wrapped = FSDPRootWrapper(
        model,
        fsdp_unit_modules=[Block],
        options=ShardingOptions(
            device_mesh=hfsdp_topology(outer, dist.get_world_size() // outer),
            sync_model_each_microbatch=sync_each,
            host_transport=transport,
        ),
    )
    topology = fsdp_units(model)[0].options.topology
    assert (topology.outer_transport is not None) == (transport == "auto")
    return wrapped


def _hfsdp_case(
    outer: int, accumulate: str = "", sync_each: bool = False, transport: str = "auto"
) -> ParityCase:
    """``accumulate``: "" (one micro-batch per step), "no_sync" (all but the last micro-batch
    under no_sync) or "finish" (all under no_sync, then finish_grad_sync)."""
    micro = MICRO if accumulate else 1
    return ParityCase(
        f"HFSDP {outer}x(world/{outer}) accumulate={accumulate} sync_each={sync_each} {transport}",
        partial(_hfsdp, outer=outer, sync_each=sync_each, transport=transport),
        optimizer=partial(make_optimizer, "adamw"),
        sharded_optimizer=attach_optimizer,
        batches=partial(make_batches, global_batch=GLOBAL_BATCH * micro),
        micro=micro,
        finish=accumulate == "finish",
        weights=full_state,
    )


def test_hfsdp_trains_as_one_process_on_2x2_and_the_edge_meshes_and_on_gloo() -> None:
    run_parity(
        4, [_hfsdp_case(2), _hfsdp_case(4), _hfsdp_case(1), _hfsdp_case(2, transport="gloo")]
    )


def test_hfsdp_trains_as_one_process_with_gradient_accumulation() -> None:
    cases = [_hfsdp_case(2, "no_sync"), _hfsdp_case(2, "finish"), _hfsdp_case(2, "no_sync", True)]
    run_parity(4, cases)


def _cycle_comm_worker(
    rank: int, world: int, mode: str
) -> tuple[list[dict[str, int]], list[int], int]:
    """Per optimisation cycle of 3 micro-batches: the calls and bytes of each collective."""
    options = ShardingOptions(device_mesh=hfsdp_topology(2, 2), sync_model_each_microbatch=False)
    model = FSDPRootWrapper(make_model(), fsdp_unit_modules=[Block], options=options)
    optimizer = attach_optimizer(make_optimizer("sgd", trainable(model)))
    micro, cycles = 3, []
    for step, (tokens, targets) in enumerate(make_batches(3 * micro, GLOBAL_BATCH)):
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
            optimizer.step()  # installs the stepped weights: the dp_outer all-gather
            optimizer.zero_grad()
            tracer.__exit__(None, None, None)
            summary = tracer.summary()
            cycles.append(
                {
                    f"{key}:{field}": value[field]
                    for key, value in summary.items()
                    for field in value
                }
            )
    groups = [g for unit in fsdp_units(model.module) for g in unit.groups if g.requires_grad]
    params = sum(len(g.dist_params) for g in groups)
    return cycles[1:], [g.layout.padded_numel for g in groups], params


@pytest.mark.parametrize("mode", ["no_sync", "finish"])
def test_hfsdp_crosses_dp_outer_once_per_cycle_with_the_analytic_bytes(mode: str) -> None:
    # ZeRO-3, 4 trainable groups, fp32, 3 micro-batches per cycle (the first cycle, which
    # records the prefetch order, is left out). Inside dp_shard every micro-batch
    # reduce-scatters the whole padded buffer; across dp_outer each group's half-buffer
    # partial is reduce-scattered once, and its updated quarter all-gathered once. The cycle's
    # one agreement on which parameters got a gradient anywhere (grad_presence) is a float
    # per parameter all-reduced in dp_shard, then across dp_outer.
    for cycles, padded, params in run_distributed(_cycle_comm_worker, 4, mode, timeout=180):
        total, groups = sum(padded), len(padded)
        for cycle in cycles:
            assert cycle["dp_shard/reduce_scatter:calls"] == 3 * groups
            assert cycle["dp_shard/reduce_scatter:bytes"] == 3 * 4 * total
            assert cycle["dp_outer/reduce_scatter:calls"] == groups
            assert cycle["dp_outer/reduce_scatter:bytes"] == 4 * total // 2
            assert cycle["dp_outer/all_gather:calls"] == groups
            assert cycle["dp_outer/all_gather:bytes"] == 4 * total // 4
            assert "dp_outer/all_reduce:calls" not in cycle
            for group in ("dp_shard", "dp_outer"):
                assert cycle[f"{group}/grad_presence:calls"] == 1
                assert cycle[f"{group}/grad_presence:bytes"] == 4 * params


def _optimizer_state_worker(rank: int, world: int, outer: int) -> tuple[int, int, int]:
    options = ShardingOptions(
        device_mesh=hfsdp_topology(outer, world // outer), sync_model_each_microbatch=False
    )
    model = FSDPRootWrapper(make_model(), fsdp_unit_modules=[Block], options=options)
    optimizer = make_optimizer("adamw", trainable(model))
    tokens, targets = make_batches(1, GLOBAL_BATCH)[0]
    loss_fn(model(local_slice(tokens, rank, world)), local_slice(targets, rank, world)).backward()
    optimizer.step()
    state = sum(
        t.to_local().numel()
        for s in optimizer.state.values()
        for t in s.values()
        if isinstance(t, torch.Tensor) and t.dim() > 0
    )
    padding = sum(
        g.layout.padded_numel - g.layout.data_numel
        for unit in fsdp_units(model.module)
        for g in unit.groups
        if g.requires_grad
    )
    return state, sum(p.numel() for p in trainable(make_model())), padding


@pytest.mark.parametrize("outer", [2, 4])
def test_hfsdp_optimizer_state_is_one_sub_shard_per_rank(outer: int) -> None:
    # AdamW keeps two tensors per parameter: per rank at most 2/(outer x shard) of the model
    # plus the padding, and the four ranks together hold exactly two copies of it.
    results = run_distributed(_optimizer_state_worker, 4, outer, timeout=120)
    for state, model_numel, padding in results:
        assert state <= 2 * (model_numel + padding) // 4
    assert sum(state for state, _, _ in results) == 2 * results[0][1]


def _main_weights_worker(rank: int, world: int, optim_across_outer: bool) -> list[list[float]]:
    """bf16 compute with fp32 main weights, on 2x2: HFSDP or HSDP."""
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_outer", "dp_shard"))
    topology = FSDPTopology.from_mesh(mesh, dp_shard_dim="dp_shard", dp_outer_dim="dp_outer")
    if optim_across_outer:
        topology.shard_optimizer_across_outer(dist.group.WORLD)  # type: ignore[arg-type]
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    options = ShardingOptions(
        device_mesh=topology, mixed_precision_policy=policy, sync_model_each_microbatch=False
    )
    model = FSDPRootWrapper(make_model(), fsdp_unit_modules=[Block], options=options)
    optimizer = attach_optimizer(make_optimizer("adamw", trainable(model)))
    for tokens, targets in make_batches(STEPS, GLOBAL_BATCH):
        local = local_slice(tokens, rank, world), local_slice(targets, rank, world)
        loss_fn(model(local[0]), local[1]).backward()
        optimizer.step()
        optimizer.zero_grad()
    state = full_state(model.module)
    return [state[name].flatten().tolist() for name in sorted(state)]  # plain data to pickle


def test_hfsdp_with_fp32_main_weights_matches_hsdp() -> None:
    # The fp32 main weights are sub-shards; the bf16 compute shard is rebuilt from them
    # across dp_outer. Both levels add the same two numbers in the same order as HSDP.
    hfsdp = run_distributed(_main_weights_worker, 4, True, timeout=180)
    hsdp = run_distributed(_main_weights_worker, 4, False, timeout=180)
    for mine, theirs in zip(hfsdp, hsdp, strict=True):
        for a, b in zip(mine, theirs, strict=True):
            assert_close_rel(torch.tensor(a), torch.tensor(b), 1e-6, "HFSDP vs HSDP, bf16")
