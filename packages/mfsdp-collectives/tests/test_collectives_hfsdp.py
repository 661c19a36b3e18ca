"""HFSDP on a 2x2 mesh: the two-level reduce-scatter against a flat all-reduce over all four
ranks, the sub-shard table of ``OptimizerSharding``, and bad groups."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from mfsdp_collectives import (
    CommTracer,
    FSDPTopology,
    ReduceSpec,
    enable_host_transport,
    hfsdp_reduce_scatter_into,
)
from mfsdp_collectives.testing import run_distributed


def _topology() -> FSDPTopology:
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_outer", "dp_shard"))
    return FSDPTopology.from_mesh(mesh, dp_shard_dim="dp_shard", dp_outer_dim="dp_outer")


def _two_level_worker(rank: int, world: int, transport: bool) -> None:
    topo = _topology()
    assert topo.outer_group is not None
    topo.shard_optimizer_across_outer(dist.group.WORLD)  # type: ignore[arg-type]
    # Sub-shard k = shard_rank * outer_size + outer_rank: rank (outer o, shard s) = 2o + s.
    assert topo.optim_rank == (rank % 2) * 2 + rank // 2
    assert topo.optim_size == 4 and [topo.optim_index_of(r) for r in range(4)] == [0, 2, 1, 3]
    route = enable_host_transport(topo.shard_group, "shm") if transport else None
    outer_route = enable_host_transport(topo.outer_group, "shm") if transport else None
    n = 3
    x = torch.randn(4 * n, generator=torch.Generator().manual_seed(10 + rank))
    flat = x.clone()
    dist.all_reduce(flat)
    mine = slice(topo.optim_rank * n, (topo.optim_rank + 1) * n)
    # What no_sync micro-batches left in this rank's partial (inner-reduced before).
    kept = torch.randn(2 * n, generator=torch.Generator().manual_seed(50 + rank))
    kept_across_outer = kept.clone()
    dist.all_reduce(kept_across_outer, group=topo.outer_group)
    o = topo.outer_rank
    with CommTracer() as tracer:
        out = torch.empty(n)
        partial = torch.empty(2 * n)
        hfsdp_reduce_scatter_into(
            x,
            out,
            topo.shard_group,
            topo.outer_group,
            partial=partial,
            transport=route,
            outer_transport=outer_route,
        ).wait()
        torch.testing.assert_close(out, flat[mine] / 4)
        # Adding to the kept partial, summing, and adding into the output.
        out = torch.ones(n)
        hfsdp_reduce_scatter_into(
            x,
            out,
            topo.shard_group,
            topo.outer_group,
            partial=kept.clone(),
            partial_accumulate=True,
            spec=ReduceSpec(average=False),
            accumulate=True,
            transport=route,
            outer_transport=outer_route,
        ).wait()
        torch.testing.assert_close(out, 1.0 + flat[mine] + kept_across_outer[o * n : (o + 1) * n])
    # Per call: the whole buffer inside dp_shard, the half-buffer partial across dp_outer.
    assert tracer.calls("reduce_scatter", "dp_shard") == 2
    assert tracer.bytes("reduce_scatter", "dp_shard") == 2 * 4 * n * 4
    assert tracer.calls("reduce_scatter", "dp_outer") == 2
    assert tracer.bytes("reduce_scatter", "dp_outer") == 2 * 2 * n * 4


@pytest.mark.parametrize("transport", [False, True])
def test_hfsdp_reduce_scatter_matches_a_flat_reduction(transport: bool) -> None:
    run_distributed(_two_level_worker, 4, transport, timeout=120)


def _bad_worker(rank: int, world: int, case: str) -> str:
    topo = _topology()
    assert topo.outer_group is not None
    try:
        if case == "half_group":
            half = [dist.new_group([0, 1]), dist.new_group([2, 3])][rank // 2]
            topo.shard_optimizer_across_outer(half)
        elif case == "overlap":
            buffer = torch.zeros(6)
            hfsdp_reduce_scatter_into(
                torch.zeros(8),
                buffer[2:4],
                topo.shard_group,
                topo.outer_group,
                partial=buffer[:4],
            )
        elif case == "partial_size":
            hfsdp_reduce_scatter_into(
                torch.zeros(8),
                torch.zeros(2),
                topo.shard_group,
                topo.outer_group,
                partial=torch.zeros(3),
            )
    except ValueError as error:
        return str(error)
    return "no error"


@pytest.mark.parametrize(
    ("case", "expected"),
    [
        ("half_group", "has 2 ranks, but dp_outer x dp_shard is 2 x 2"),
        ("overlap", "partial and out_sub_shard overlap"),
        ("partial_size", "unsharded_grad has 8 elements but partial has 3"),
    ],
)
def test_bad_hfsdp_arguments_raise_on_every_rank(case: str, expected: str) -> None:
    messages = run_distributed(_bad_worker, 4, case, timeout=60)
    assert all(expected in m for m in messages), messages
