"""Shared-memory collectives as torch's ``CommDebugMode`` sees them (``mode_echo``).

Before, a collective over the shared-memory transport dispatched no c10d op, so the mode
counted nothing. Now it counts each under torch's name, and the echo communicates nothing:
results are bitwise those without a mode, and a mode on one rank only does not hang.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
from torch.distributed.tensor.debug import CommDebugMode

from mfsdp_buffers import FlatPieces
from mfsdp_collectives import (
    ReduceSpec,
    all_gather_into,
    coalesced_gathers,
    enable_host_transport,
    reduce_scatter_into,
)
from mfsdp_collectives.testing import run_distributed

c10d = torch.ops.c10d
Counts = dict[str, int]


def _collectives(rank: int, world: int, mode: CommDebugMode | None) -> tuple[list[bytes], Counts]:
    """A reduce-scatter of a tensor, one of pieces, two all-gathers coalesced into one and a
    plain one, all over shared memory: their results' bytes and what ``mode`` counted."""
    group = dist.group.WORLD
    assert group is not None
    transport = enable_host_transport(group, "shm")
    gen = torch.Generator().manual_seed(rank)
    dense = torch.randn(10 * world, generator=gen)
    pieces = FlatPieces(
        6 * world, [(1, torch.randn(4, generator=gen))], dtype=torch.float32, device=dense.device
    )
    outs = [torch.empty(n) for n in (10, 6)] + [torch.empty(n * world) for n in (3, 5, 7)]
    with mode if mode is not None else contextlib.nullcontext():
        for inp, out in ((dense, outs[0]), (pieces, outs[1])):
            spec = ReduceSpec(average=False)
            reduce_scatter_into(inp, out, group, spec=spec, transport=transport).wait()
        with coalesced_gathers():
            first = all_gather_into(
                torch.full((3,), rank + 0.5), outs[2], group, transport=transport
            )
            second = all_gather_into(
                torch.full((5,), rank - 1.0), outs[3], group, transport=transport
            )
        first.wait()
        second.wait()
        all_gather_into(torch.randn(7, generator=gen), outs[4], group, transport=transport).wait()
    counts = {} if mode is None else {str(op): n for op, n in mode.get_comm_counts().items()}
    return [out.numpy().tobytes() for out in outs], counts


def _worker(rank: int, world: int) -> tuple[bool, Counts, Counts]:
    plain, _ = _collectives(rank, world, None)
    seen, counts = _collectives(rank, world, CommDebugMode())  # type: ignore[no-untyped-call]
    # A mode on rank 0 alone: the echo involves no peer, so nothing waits on rank 1.
    alone, counts_alone = _collectives(
        rank,
        world,
        CommDebugMode() if rank == 0 else None,  # type: ignore[no-untyped-call]
    )
    return plain == seen == alone, counts, counts_alone


def test_comm_debug_mode_counts_shared_memory_collectives_without_changing_them() -> None:
    """Failed before: the mode counted {} (nothing) where 2 reduce-scatters and 2
    all-gathers (the coalesced pair is one collective, as for our tracer) were issued."""
    results = run_distributed(_worker, 2, timeout=60)
    want = {"c10d._reduce_scatter_base_": 2, "c10d._allgather_base_": 2}
    assert results[0] == (True, want, want)
    assert results[1] == (True, want, {})
