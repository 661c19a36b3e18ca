"""Every op against a locally computed reference, on 2 and 3 ranks.

Each rank builds *every* rank's input from a per-rank seeded generator, so the
expected result of a collective is computed locally and compared exactly (or
to summation-order rounding).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable

import pytest
import torch
import torch.distributed as dist

import mfsdp_collectives.core._compat as compat
import mfsdp_collectives.issuing._reduce as reduce_mod
from mfsdp_collectives import (
    CommStreams,
    CommTracer,
    ReduceSpec,
    all_gather_into,
    all_reduce_,
    broadcast_,
    reduce_scatter_into,
)
from mfsdp_collectives.testing import run_distributed


def inputs(world_size: int, numel: int, dtype: torch.dtype, seed: int) -> list[torch.Tensor]:
    """The input every rank would use, identical on all ranks."""
    out = []
    for r in range(world_size):
        gen = torch.Generator().manual_seed(seed * 1000 + r)
        out.append(torch.randn(numel, generator=gen).to(dtype))
    return out


def close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    assert actual.dtype == expected.dtype, (actual.dtype, expected.dtype)
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-6)


def check_all_gather(rank: int, ws: int) -> None:
    group = dist.group.WORLD
    assert group is not None
    for dtype in (torch.float32, torch.bfloat16):
        shards = inputs(ws, 5, dtype, seed=1)
        out = torch.full((5 * ws,), float("nan"), dtype=dtype)
        handle = all_gather_into(shards[rank], out, group)
        handle.wait()
        handle.wait()  # idempotent
        assert handle.is_completed()
        assert torch.equal(out, torch.cat(shards))
        # synchronous, with (inert on CPU) streams
        out2 = torch.zeros_like(out)
        h2 = all_gather_into(shards[rank], out2, group, async_op=False, stream=CommStreams("cpu"))
        assert h2.is_completed()
        assert torch.equal(out2, torch.cat(shards))
    # shard already sitting in its own slot of the unsharded buffer
    full = torch.cat(inputs(ws, 4, torch.float32, seed=2))
    buf = torch.zeros_like(full)
    buf[rank * 4 : (rank + 1) * 4] = full[rank * 4 : (rank + 1) * 4]
    all_gather_into(buf[rank * 4 : (rank + 1) * 4], buf, group).wait()
    assert torch.equal(buf, full)


def expected_reduce(
    xs: list[torch.Tensor],
    *,
    average: bool,
    pre: float | None = None,
    post: float | None = None,
    reduce_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    rdt = reduce_dtype or xs[0].dtype
    ys = [x.to(rdt) * (pre if pre is not None else 1.0) for x in xs]
    total = torch.stack(ys).sum(0)
    if average:
        total = total / len(xs)
    if post is not None:
        total = total * post
    return total


def check_reduce_scatter(rank: int, ws: int) -> None:
    group = dist.group.WORLD
    assert group is not None
    n = 6
    xs = inputs(ws, n * ws, torch.float32, seed=3)
    mine = slice(rank * n, (rank + 1) * n)
    for average in (False, True):
        out = torch.empty(n)
        reduce_scatter_into(xs[rank], out, group, spec=ReduceSpec(average=average)).wait()
        close(out, expected_reduce(xs, average=average)[mine])
    # pre/post scaling
    out = torch.empty(n)
    reduce_scatter_into(
        xs[rank], out, group, spec=ReduceSpec(average=True, pre_scale=0.5, post_scale=3.0)
    ).wait()
    close(out, expected_reduce(xs, average=True, pre=0.5, post=3.0)[mine])
    # input left untouched by pre-scaling
    assert torch.equal(xs[rank], inputs(ws, n * ws, torch.float32, seed=3)[rank])
    # accumulate into an existing shard
    base = torch.arange(n, dtype=torch.float32)
    out = base.clone()
    reduce_scatter_into(
        xs[rank], out, group, spec=ReduceSpec(average=False), accumulate=True
    ).wait()
    close(out, base + expected_reduce(xs, average=False)[mine])
    # bf16 gradients reduced in fp32, cast back on the way out
    xb = inputs(ws, n * ws, torch.bfloat16, seed=4)
    outb = torch.empty(n, dtype=torch.bfloat16)
    h = reduce_scatter_into(
        xb[rank], outb, group, spec=ReduceSpec(reduce_dtype=torch.float32, post_scale=2.0)
    )
    h.wait()
    ref = expected_reduce(xb, average=True, post=2.0, reduce_dtype=torch.float32)[mine]
    torch.testing.assert_close(outb, ref.to(torch.bfloat16))
    # bf16 accumulate with fp32 reduction
    accb = torch.ones(n, dtype=torch.bfloat16)
    reduce_scatter_into(
        xb[rank], accb, group, spec=ReduceSpec(reduce_dtype=torch.float32), accumulate=True
    ).wait()
    ref = expected_reduce(xb, average=True, reduce_dtype=torch.float32)[mine] + 1.0
    torch.testing.assert_close(accb, ref.to(torch.bfloat16))
    # fp32 shard of bf16 grads (main grads in fp32)
    out32 = torch.empty(n)
    reduce_scatter_into(xb[rank], out32, group, spec=ReduceSpec(reduce_dtype=torch.float32)).wait()
    close(out32, expected_reduce(xb, average=True, reduce_dtype=torch.float32)[mine])
    # uneven logical content: 10 real elements padded with zeros to a multiple of ws
    logical = 10
    per = -(-logical // ws)
    padded = []
    for x in inputs(ws, logical, torch.float32, seed=5):
        p = torch.zeros(per * ws)
        p[:logical] = x
        padded.append(p)
    out = torch.full((per,), float("nan"))
    reduce_scatter_into(padded[rank], out, group, spec=ReduceSpec(average=True)).wait()
    exp = expected_reduce(padded, average=True)[rank * per : (rank + 1) * per]
    close(out, exp)
    if (rank + 1) * per > logical:
        assert torch.all(out[max(0, logical - rank * per) :] == 0)
    # out_shard aliasing its own slot of the input
    buf = xs[rank].clone()
    slot = buf[mine]
    reduce_scatter_into(buf, slot, group, spec=ReduceSpec(average=False)).wait()
    close(slot, expected_reduce(xs, average=False)[mine])
    # several in flight at once, completed out of order
    outs = [torch.empty(n) for _ in range(3)]
    hs = [
        reduce_scatter_into(xs[rank], o, group, spec=ReduceSpec(post_scale=float(i + 1)))
        for i, o in enumerate(outs)
    ]
    for i in (2, 0, 1):
        hs[i].wait()
        close(outs[i], expected_reduce(xs, average=True, post=float(i + 1))[mine])


def check_all_reduce_and_broadcast(rank: int, ws: int) -> None:
    group = dist.group.WORLD
    assert group is not None
    xs = inputs(ws, 7, torch.float32, seed=6)
    t = xs[rank].clone()
    all_reduce_(t, group).wait()
    close(t, expected_reduce(xs, average=True))
    t = xs[rank].clone()
    all_reduce_(
        t, group, spec=ReduceSpec(average=False, pre_scale=0.25, post_scale=2.0), async_op=False
    )
    close(t, expected_reduce(xs, average=False, pre=0.25, post=2.0))
    xb = inputs(ws, 7, torch.bfloat16, seed=7)
    tb = xb[rank].clone()
    all_reduce_(tb, group, spec=ReduceSpec(reduce_dtype=torch.float32)).wait()
    ref = expected_reduce(xb, average=True, reduce_dtype=torch.float32)
    torch.testing.assert_close(tb, ref.to(torch.bfloat16))
    src = ws - 1
    b = xs[rank].clone()
    broadcast_(b, src, group)
    assert torch.equal(b, xs[src])


def check_without_avg_backend(rank: int, ws: int) -> None:
    """Backends without ReduceOp.AVG: SUM, then divide the output shard."""
    group = dist.group.WORLD
    assert group is not None
    saved = compat._AVG_BACKENDS
    compat._AVG_BACKENDS = frozenset()
    try:
        n = 3
        xs = inputs(ws, n * ws, torch.float32, seed=8)
        out = torch.empty(n)
        reduce_scatter_into(xs[rank], out, group, spec=ReduceSpec(post_scale=2.0)).wait()
        close(out, expected_reduce(xs, average=True, post=2.0)[rank * n : (rank + 1) * n])
        t = xs[rank].clone()
        all_reduce_(t, group).wait()
        close(t, expected_reduce(xs, average=True))
        op, factor = reduce_mod.reduce_op(group, True)
        assert op == dist.ReduceOp.SUM and factor == pytest.approx(1.0 / ws)
    finally:
        compat._AVG_BACKENDS = saved
    assert reduce_mod.reduce_op(group, True)[0] == dist.ReduceOp.AVG


def check_legacy_collectives(rank: int, ws: int) -> None:
    """torch < 2.13: the compat layer falls back to the old function names."""
    group = dist.group.WORLD
    assert group is not None
    saved = (compat._NEW_ALL_GATHER, compat._NEW_REDUCE_SCATTER)
    compat._NEW_ALL_GATHER = compat._NEW_REDUCE_SCATTER = None
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            xs = inputs(ws, 2 * ws, torch.float32, seed=9)
            out = torch.empty(2 * ws * ws)
            all_gather_into(xs[rank], out, group).wait()
            assert torch.equal(out, torch.cat(xs))
            shard = torch.empty(2)
            reduce_scatter_into(xs[rank], shard, group, spec=ReduceSpec(average=False)).wait()
            close(shard, expected_reduce(xs, average=False)[rank * 2 : (rank + 1) * 2])
    finally:
        compat._NEW_ALL_GATHER, compat._NEW_REDUCE_SCATTER = saved
    # and the current API must not warn
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        all_gather_into(xs[rank], out, group).wait()
        reduce_scatter_into(xs[rank], shard, group).wait()


def check_tracer(rank: int, ws: int) -> None:
    group = dist.group.WORLD
    assert group is not None
    name = "pg[" + (",".join(map(str, range(ws))) if ws <= 2 else f"0-{ws - 1}") + "]"
    with CommTracer() as outer:
        with CommTracer() as inner:
            all_gather_into(
                torch.zeros(4, dtype=torch.bfloat16),
                torch.zeros(4 * ws, dtype=torch.bfloat16),
                group,
            ).wait()
            reduce_scatter_into(
                torch.zeros(3 * ws, dtype=torch.bfloat16),
                torch.zeros(3, dtype=torch.bfloat16),
                group,
                spec=ReduceSpec(reduce_dtype=torch.float32),
            ).wait()
        all_reduce_(torch.zeros(5), group).wait()
        broadcast_(torch.zeros(2, dtype=torch.int64), 0, group)
    assert inner.calls("all_gather") == 1 and inner.bytes("all_gather") == 4 * 2
    assert inner.calls("reduce_scatter", name) == 1
    assert inner.bytes("reduce_scatter") == 3 * ws * 4, "bytes in the reduce dtype"
    assert inner.calls("all_reduce") == 0
    assert outer.calls("all_reduce") == 1 and outer.bytes("all_reduce") == 20
    assert outer.calls("broadcast", name) == 1 and outer.bytes("broadcast") == 16
    assert outer.calls("all_gather", "dp_shard") == 0
    assert [r.op for r in outer.records] == [
        "all_gather",
        "reduce_scatter",
        "all_reduce",
        "broadcast",
    ]
    assert outer.records[1].dtype == torch.float32 and outer.records[1].numel == 3 * ws
    assert outer.summary()[f"{name}/all_gather"] == {"calls": 1, "bytes": 8}
    outer.reset()
    assert outer.records == []


def _ops_world(rank: int, ws: int, checks: list[str]) -> list[str]:
    done = []
    for check in checks:
        fn: Callable[[int, int], None] = globals()[check]
        fn(rank, ws)
        done.append(check)
    return done


CHECKS = [
    "check_all_gather",
    "check_reduce_scatter",
    "check_all_reduce_and_broadcast",
    "check_without_avg_backend",
    "check_legacy_collectives",
    "check_tracer",
]


@pytest.mark.parametrize("world_size", [2, 3])
def test_ops_match_local_reference(world_size: int) -> None:
    results = run_distributed(_ops_world, world_size, CHECKS, timeout=90)
    assert results == [CHECKS] * world_size
