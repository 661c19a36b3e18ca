"""HSDP on a 2x2 mesh against a flat all-reduce over all four ranks."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

import mfsdp_collectives.core._compat as compat
from mfsdp_collectives import (
    CommStreams,
    CommTracer,
    FSDPTopology,
    ReduceSpec,
    all_gather_into,
    group_name,
    hsdp_reduce_scatter_into,
)
from mfsdp_collectives.testing import run_distributed


def _flat_reference(x: torch.Tensor, average: bool) -> torch.Tensor:
    """What HSDP must equal: an all-reduce over the whole world."""
    ref = x.clone()
    dist.all_reduce(ref, op=dist.ReduceOp.AVG if average else dist.ReduceOp.SUM)
    return ref


def _hsdp_world(rank: int, ws: int) -> dict[str, object]:
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_outer", "dp_shard"))
    topo = FSDPTopology.from_mesh(mesh, dp_shard_dim="dp_shard", dp_outer_dim="dp_outer")
    assert topo.device == torch.device("cpu")
    assert (topo.shard_size, topo.outer_size) == (2, 2)
    assert topo.shard_rank == rank % 2 and topo.outer_rank == rank // 2
    assert topo.is_hsdp and topo.mesh is mesh
    assert topo.shard_mesh is not None and topo.shard_mesh.mesh_dim_names == ("dp_shard",)
    assert group_name(topo.shard_group) == "dp_shard"
    assert topo.outer_group is not None and group_name(topo.outer_group) == "dp_outer"

    n = 5
    gen = torch.Generator().manual_seed(100 + rank)
    x = torch.randn(2 * n, generator=gen)
    mine = slice(topo.shard_rank * n, (topo.shard_rank + 1) * n)
    streams = CommStreams(topo.device)

    with CommTracer() as tracer:
        for average in (True, False):
            out = torch.empty(n)
            h = hsdp_reduce_scatter_into(
                x,
                out,
                topo.shard_group,
                topo.outer_group,
                spec=ReduceSpec(average=average),
                stream=streams,
            )
            h.wait()
            torch.testing.assert_close(out, _flat_reference(x, average)[mine])

    # one RS in dp_shard (full buffer) and one AR in dp_outer (the shard) per call
    assert tracer.calls("reduce_scatter", "dp_shard") == 2
    assert tracer.bytes("reduce_scatter", "dp_shard") == 2 * 2 * n * 4
    assert tracer.calls("all_reduce", "dp_outer") == 2
    assert tracer.bytes("all_reduce", "dp_outer") == 2 * n * 4
    assert tracer.calls("reduce_scatter", "dp_outer") == 0

    # scaling, accumulation and an fp32 reduction of bf16 gradients
    out = torch.ones(n)
    hsdp_reduce_scatter_into(
        x,
        out,
        topo.shard_group,
        topo.outer_group,
        spec=ReduceSpec(pre_scale=0.5, post_scale=4.0),
        accumulate=True,
    ).wait()
    torch.testing.assert_close(out, 1.0 + 2.0 * _flat_reference(x, True)[mine])
    xb = x.to(torch.bfloat16)
    outb = torch.empty(n, dtype=torch.bfloat16)
    hsdp_reduce_scatter_into(
        xb, outb, topo.shard_group, topo.outer_group, spec=ReduceSpec(reduce_dtype=torch.float32)
    ).wait()
    ref = _flat_reference(xb.float(), True)[mine].to(torch.bfloat16)
    torch.testing.assert_close(outb, ref)

    # a backend without AVG: SUM on both levels, one division of the shard by 4
    saved = compat._AVG_BACKENDS
    compat._AVG_BACKENDS = frozenset()
    try:
        out = torch.empty(n)
        hsdp_reduce_scatter_into(x, out, topo.shard_group, topo.outer_group).wait()
        torch.testing.assert_close(out, _flat_reference(x, True)[mine])
    finally:
        compat._AVG_BACKENDS = saved

    # outer_group=None is plain FSDP over the shard group
    out = torch.empty(n)
    hsdp_reduce_scatter_into(x, out, topo.shard_group, None, spec=ReduceSpec(average=False)).wait()
    expected = x.clone()
    dist.all_reduce(expected, group=topo.shard_group)
    torch.testing.assert_close(out, expected[mine])

    # all-gather inside dp_shard: members are (2*outer, 2*outer + 1), each sends its own slot
    full = torch.empty(2 * n)
    all_gather_into(x[mine].clone(), full, topo.shard_group).wait()
    members = [2 * topo.outer_rank, 2 * topo.outer_rank + 1]
    xs = [torch.randn(2 * n, generator=torch.Generator().manual_seed(100 + r)) for r in members]
    assert torch.equal(full, torch.cat([xs[0][:n], xs[1][n:]]))
    return {"shard_rank": topo.shard_rank, "outer_rank": topo.outer_rank}


def test_hsdp_2x2_matches_flat_all_reduce() -> None:
    results = run_distributed(_hsdp_world, 4, timeout=90)
    assert [(r["outer_rank"], r["shard_rank"]) for r in results] == [(0, 0), (0, 1), (1, 0), (1, 1)]
