"""The tracer's bookkeeping, without a process group (the ops' records are
checked exactly in the distributed tests)."""

from __future__ import annotations

import threading

import pytest
import torch

from mfsdp_collectives import CommTracer
from mfsdp_collectives.tracing.tracer import record_comm


def test_counts_bytes_records_and_summary() -> None:
    with CommTracer() as t:
        record_comm("all_gather", "dp_shard", 10, torch.bfloat16)
        record_comm("all_gather", "dp_shard", 6, torch.bfloat16)
        record_comm("reduce_scatter", "dp_shard", 8, torch.float32)
        record_comm("all_reduce", "dp_outer", 3, torch.float32)
    record_comm("all_gather", "dp_shard", 100, torch.float32)  # after exit: not counted
    assert t.calls("all_gather") == 2 and t.bytes("all_gather") == 32
    assert t.calls("all_gather", "dp_outer") == 0
    assert t.bytes("reduce_scatter", "dp_shard") == 32
    assert t.bytes("all_reduce", "dp_outer") == 12
    assert [(r.op, r.group, r.numel, r.dtype) for r in t.records][-1] == (
        "all_reduce",
        "dp_outer",
        3,
        torch.float32,
    )
    assert t.summary() == {
        "dp_shard/all_gather": {"calls": 2, "bytes": 32},
        "dp_shard/reduce_scatter": {"calls": 1, "bytes": 32},
        "dp_outer/all_reduce": {"calls": 1, "bytes": 12},
    }
    t.reset()
    assert t.records == [] and t.summary() == {}
    with pytest.raises(ValueError, match="not a traced op"):
        t.calls("allgather")


def test_nested_and_reentered_tracers_each_record_once() -> None:
    outer = CommTracer()
    with outer:
        record_comm("broadcast", "pg[0,1]", 4, torch.int64)
        with CommTracer() as inner, outer:  # re-entering outer must not double-count
            record_comm("broadcast", "pg[0,1]", 4, torch.int64)
        record_comm("broadcast", "pg[0,1]", 4, torch.int64)
    assert inner.calls("broadcast") == 1
    assert outer.calls("broadcast") == 3 and outer.bytes("broadcast") == 96


def test_thread_safe_counting() -> None:
    per_thread, threads = 500, 8

    def work() -> None:
        for _ in range(per_thread):
            record_comm("reduce_scatter", "dp_shard", 2, torch.float32)

    with CommTracer() as t:
        pool = [threading.Thread(target=work) for _ in range(threads)]
        for th in pool:
            th.start()
        for th in pool:
            th.join()
    assert t.calls("reduce_scatter") == per_thread * threads
    assert t.bytes("reduce_scatter") == per_thread * threads * 8


def _c10d_worker(rank: int, world: int) -> list[tuple[str, int, int]]:
    """torch's own collectives, then ours over c10d, under one C10dTracer and one CommTracer."""
    import torch.distributed as dist

    from mfsdp_collectives import C10dTracer, ReduceSpec, all_gather_into, reduce_scatter_into

    group = dist.group.WORLD
    with C10dTracer() as theirs, CommTracer() as ours:
        full = torch.ones(6 * world, dtype=torch.bfloat16)
        dist.reduce_scatter_tensor(torch.empty(6, dtype=torch.bfloat16), full)
        dist.all_gather_into_tensor(torch.empty(4 * world), torch.ones(4))
        dist.all_reduce(torch.ones(3, dtype=torch.float64))
        grads = torch.ones(8 * world)
        reduce_scatter_into(grads, torch.empty(8), group, spec=ReduceSpec(), async_op=False)
        all_gather_into(torch.ones(5), torch.empty(5 * world), group, async_op=False)
    assert ours.calls("reduce_scatter") == ours.calls("all_gather") == 1  # ours only
    return [(r.op, r.numel, r.bytes) for r in theirs.records]


def test_c10d_tracer_records_torch_collectives_like_ours() -> None:
    """Bytes sent in: a reduce-scatter's whole input, an all-gather's shard, an all-reduce's
    tensor, for torch's collectives and ours alike (ours over c10d: no host transport)."""
    from mfsdp_collectives.testing import run_distributed

    results = run_distributed(_c10d_worker, 2, timeout=60)
    expected = [
        ("reduce_scatter", 12, 24),
        ("all_gather", 4, 16),
        ("all_reduce", 3, 24),
        ("reduce_scatter", 16, 64),
        ("all_gather", 5, 20),
    ]
    assert results == [expected, expected]
