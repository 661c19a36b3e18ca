"""How fast the collectives themselves are on this machine, with no model around them.

A floor for exposed communication: if one step's all-gathers and reduce-scatters need
``T`` ms of pure collective time here, an engine can hide at most the compute it overlaps
them with, and on a CPU-only box the collectives' copies and reductions run on the same
cores as that compute.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

REPEATS = 5

# torch 2.13 renamed the tensor collectives (the old names warn on every call).
_ALL_GATHER: Callable[..., Any] = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)
_REDUCE_SCATTER: Callable[..., Any] = getattr(
    dist, "reduce_scatter_single", dist.reduce_scatter_tensor
)


def _median_s(fn: Callable[[], object]) -> float:
    times = []
    for _ in range(REPEATS):
        dist.barrier()
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def collective_speed(
    rank: int, world: int, gather_shard_bytes: int, scatter_input_bytes: int, dtype_name: str
) -> dict[str, float]:
    """Median ms and GB/s (bytes this rank sends in, per second) of one all-gather of a
    ``gather_shard_bytes`` shard and one reduce-scatter of a ``scatter_input_bytes`` input."""
    dtype = getattr(torch, dtype_name)
    size = torch.empty(0, dtype=dtype).element_size()
    shard = torch.ones(max(1, gather_shard_bytes // size), dtype=dtype)
    full = torch.empty(shard.numel() * world, dtype=dtype)
    rs_out = torch.empty(max(1, scatter_input_bytes // size // world), dtype=dtype)
    rs_in = torch.ones(rs_out.numel() * world, dtype=dtype)
    ag = _median_s(lambda: _ALL_GATHER(full, shard))
    rs = _median_s(lambda: _REDUCE_SCATTER(rs_out, rs_in))
    return {
        "all_gather_ms": 1e3 * ag,
        "all_gather_gbps": shard.numel() * size / ag / 1e9,
        "reduce_scatter_ms": 1e3 * rs,
        "reduce_scatter_gbps": rs_in.numel() * size / rs / 1e9,
    }
