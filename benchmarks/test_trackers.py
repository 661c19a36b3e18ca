"""Unit check of the collective counter the benchmark's figures rest on (no timing involved).

The live-tensor tracker is tested with mfsdp-buffers, where it lives.

Run with ``pytest benchmarks/test_trackers.py``.
"""

from __future__ import annotations

import torch

from benchmarks.comm_count import CollectiveCounter
from mfsdp_buffers import LiveTensorTracker
from mfsdp_collectives.testing import run_distributed

KB = 4 * 1024  # bytes of 1024 fp32 elements


def _dtensor_and_collectives(rank: int, world: int) -> tuple[int, dict[str, dict[str, int]]]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    mesh = init_device_mesh("cpu", (world,))
    with LiveTensorTracker() as mem, CollectiveCounter() as comm:
        local = torch.ones(256)
        d = DTensor.from_local(local, mesh, [Shard(0)], run_check=False)
        before = mem.live
        e = d * 2  # a DTensor op: its local output must be counted
        grown = mem.live - before
        out = torch.empty(256 * world)
        torch.distributed.all_gather_into_tensor(out, local)
        torch.distributed.reduce_scatter_tensor(local, out)
        torch.distributed.all_reduce(local)
        del e
    return grown, comm.summary()


def test_dtensor_outputs_and_collective_bytes() -> None:
    for grown, summary in run_distributed(_dtensor_and_collectives, 2, timeout=60):
        assert grown == 256 * 4
        assert summary == {
            "all_gather": {"calls": 1, "bytes": 256 * 4},
            "all_reduce": {"calls": 1, "bytes": 256 * 4},
            "reduce_scatter": {"calls": 1, "bytes": 512 * 4},
        }
