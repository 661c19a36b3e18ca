"""Collectives that issue no c10d op, shown to torch's dispatch modes as the c10d op they are.

A mode (``CommDebugMode``, FSDP2's memory tracker) sees the c10d ops of its own thread, and the
shared-memory transport issues none. So while a mode is active on the issuing thread, the
transport also dispatches that c10d op on the real group with *meta* tensors of the real
shapes: torch's meta kernels communicate nothing and touch no data. Why not go through gloo
for real while a mode is on: a mode is one rank's affair, and a rank that switched transport
alone would wait forever; the echo involves no peer. Without a mode: one look at the thread's
mode stack per collective.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..core._compat import all_gather_single, dispatch_mode_active, reduce_scatter_single

__all__ = ["echo_all_gather", "echo_reduce_scatter"]

_META = torch.device("meta")


def echo_all_gather(group: dist.ProcessGroup, size: int, numel: int, dtype: torch.dtype) -> None:
    """Show an all-gather of ``numel`` elements per rank over ``group`` (of ``size`` ranks)
    to the dispatch modes active on this thread, if any (module doc)."""
    if not dispatch_mode_active():
        return
    shard = torch.empty(numel, dtype=dtype, device=_META)
    all_gather_single(shard.new_empty(size * numel), shard, group, async_op=False)


def echo_reduce_scatter(
    group: dist.ProcessGroup, size: int, numel: int, dtype: torch.dtype, *, average: bool
) -> None:
    """Show a reduce-scatter of ``numel`` elements in (a mean when ``average``, else a sum)
    to the dispatch modes active on this thread, if any (module doc)."""
    if not dispatch_mode_active():
        return
    full = torch.empty(numel, dtype=dtype, device=_META)
    op = dist.ReduceOp.AVG if average else dist.ReduceOp.SUM
    reduce_scatter_single(full.new_empty(numel // size), full, op, group, async_op=False)
