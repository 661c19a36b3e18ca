"""The public async collectives on flat buffers: each checks every argument locally (a
mistake raises on the calling rank instead of hanging the others), then issues through its
group's ``Route``. The package README walks through one all-gather and one reduce-scatter."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

from mfsdp_buffers import FlatPieces

from ..comms.custom_comms import AllGatherComm, ReduceScatterComm, check_comm
from ..core._checks import check_flat, check_same_device, overlaps
from ..core.naming import group_name
from ..host.shm import SharedMemoryTransport
from ..issuing._op_args import (
    check_reduce_scatter,
    check_shard_sizes,
    membership,
    peers,
    reduce_spec,
    side_stream,
)
from ..issuing._reduce import ReduceSpec
from ..issuing.handle import CommHandle
from ..issuing.streams import CommStreams
from ..safety.liveness import naming_dead_peers
from ..tracing.tracer import record_comm
from .route import MEAN, Route

__all__ = [
    "all_gather_into",
    "all_reduce_",
    "broadcast_",
    "reduce_scatter_into",
]


def all_gather_into(
    shard: torch.Tensor,
    unsharded: torch.Tensor,
    group: dist.ProcessGroup,
    *,
    async_op: bool = True,
    stream: CommStreams | None = None,
    transport: SharedMemoryTransport | None = None,
    comm: AllGatherComm | None = None,
) -> CommHandle:
    """Gather every rank's ``shard`` straight into ``unsharded`` (no staging copy); ``shard``
    may be this rank's own slot of ``unsharded``. ``transport`` (from ``enable_host_transport``)
    carries it over shared memory, else c10d. ``comm`` (FSDP2's ``AllGather`` protocol) runs it
    instead, in a buffer of its own, never coalesced."""
    shard = check_flat(shard, "shard")
    unsharded = check_flat(unsharded, "unsharded")
    at = peers(group, "group", transport)
    check_same_device(shard, "shard", unsharded, "unsharded")
    if shard.dtype != unsharded.dtype:
        raise ValueError(
            f"shard has dtype {shard.dtype} but unsharded has {unsharded.dtype}; "
            "gather into a buffer of the shard's dtype and cast afterwards"
        )
    check_shard_sizes(unsharded.numel(), "unsharded", shard, "shard", at.size)
    n, rank = shard.numel(), at.rank
    if overlaps(shard, unsharded) and shard.data_ptr() != unsharded[rank * n :].data_ptr():
        raise ValueError(
            "shard overlaps unsharded but is not this rank's slot; pass "
            f"unsharded[{rank * n}:{(rank + 1) * n}] or a separate tensor"
        )
    side_stream(stream, "all_gather", shard.device)
    if comm is not None:
        check_comm(comm, "comm")
    route = Route.over(at)
    return route.all_gather_into(shard, unsharded, stream=stream, comm=comm, async_op=async_op)


def reduce_scatter_into(
    unsharded_grad: torch.Tensor | FlatPieces,
    out_shard: torch.Tensor,
    group: dist.ProcessGroup,
    *,
    spec: ReduceSpec = MEAN,
    accumulate: bool = False,
    async_op: bool = True,
    stream: CommStreams | None = None,
    transport: SharedMemoryTransport | None = None,
    comm: ReduceScatterComm | None = None,
    after_reduce: Callable[[torch.Tensor], None] | None = None,
) -> CommHandle:
    """Reduce ``unsharded_grad`` over ``group`` and store (or add) this rank's chunk.

    ``out_shard (+)= post_scale * reduce(pre_scale * unsharded_grad.to(reduce_dtype))``
    where reduce is a mean over the group when ``spec.average`` else a sum.
    ``unsharded_grad`` may be ``FlatPieces`` (e.g. per-parameter gradients at their layout
    offsets): the shared-memory transport reads it in place; elsewhere it is copied into one
    flat tensor first. ``comm`` (FSDP2's ``ReduceScatter`` protocol) runs the collective
    instead of c10d or the transport. ``after_reduce`` (FSDP2's all-reduce hook) sees the
    reduced chunk, in the reduce dtype, before any factor still owed is applied and before
    it is stored: where the collective averaged, the mean; under ``spec.sum_only``, the sum.
    """
    inp, out, at = check_reduce_scatter(unsharded_grad, out_shard, group, "group", spec, transport)
    side_stream(stream, "reduce_scatter", out.device)
    if comm is not None:
        check_comm(comm, "comm")
    return Route.over(at).reduce_scatter_into(
        inp,
        out,
        spec=spec,
        accumulate=bool(accumulate),
        stream=stream,
        comm=comm,
        after_reduce=after_reduce,
        async_op=async_op,
    )


def all_reduce_(
    tensor: torch.Tensor,
    group: dist.ProcessGroup,
    *,
    spec: ReduceSpec = MEAN,
    async_op: bool = True,
    stream: CommStreams | None = None,
    outer_group: dist.ProcessGroup | None = None,
    after_reduce: Callable[[torch.Tensor], None] | None = None,
    record_as: str = "all_reduce",
) -> CommHandle:
    """In-place all-reduce of a whole buffer (``no_shard`` gradients), same semantics as RS.
    ``after_reduce`` sees the reduced tensor before any factor still owed (as in
    ``reduce_scatter_into``). ``record_as``: the op name ``CommTracer`` files it under (an
    all-reduce that is not a gradient reduction, such as ``"grad_presence"``, is counted
    apart from those).

    With ``stream`` it runs on the reduce-scatter stream: it is the gradient
    reduction of ``no_shard`` and must not queue behind parameter all-gathers. With
    ``outer_group`` (HSDP) the result is then all-reduced across it too, on the outer
    stream: the mean (or sum) over every rank of both groups.
    """
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"tensor must be a torch.Tensor, got {type(tensor).__name__}")
    if not tensor.is_contiguous():
        raise ValueError("tensor must be contiguous; reduce a contiguous flat buffer")
    at = peers(group, "group")
    outer = None if outer_group is None else peers(outer_group, "outer_group")
    if outer is not None and outer.group is at.group:
        raise ValueError("outer_group must differ from group; pass outer_group=None")
    reduce_spec(spec)
    side_stream(stream, "reduce_scatter", tensor.device)  # checks the stream's device
    return Route.over(at).all_reduce_(
        tensor,
        spec=spec,
        stream=stream,
        outer=None if outer is None else Route.over(outer),
        after_reduce=after_reduce,
        record_as=record_as,
        async_op=async_op,
    )


def broadcast_(tensor: torch.Tensor, src_rank_in_group: int, group: dist.ProcessGroup) -> None:
    """Overwrite ``tensor`` on every rank of ``group`` with the source rank's (blocking)."""
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"tensor must be a torch.Tensor, got {type(tensor).__name__}")
    if not tensor.is_contiguous():
        raise ValueError("tensor must be contiguous; broadcast a contiguous buffer")
    group, _, size = membership(group, "group")
    src = src_rank_in_group
    if isinstance(src, bool) or not isinstance(src, int) or not 0 <= src < size:
        raise ValueError(
            f"src_rank_in_group={src!r} must be an int in [0, {size}): a rank inside the "
            "group, not a global rank"
        )
    record_comm("broadcast", group_name(group), tensor.numel(), tensor.dtype)
    with naming_dead_peers(f"broadcast on group {group_name(group)}", group):
        dist.broadcast(tensor, group=group, group_src=src)  # src: a rank inside the group
