"""Hierarchical gradient reduction: inside the shard group, then across ``dp_outer``.

HSDP all-reduces the shard across the replicas; HFSDP reduce-scatters it across them, so
each rank ends with 1/(shard x outer) of the gradient.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

from mfsdp_buffers import FlatPieces

from ..comms.custom_comms import ReduceScatterComm, check_comm
from ..core._checks import check_flat, check_same_device, overlaps
from ..host.shm import SharedMemoryTransport
from ..issuing._op_args import check_reduce_scatter, check_shard_sizes, peers, side_stream
from ..issuing._reduce import ReduceSpec
from ..issuing.handle import CommHandle
from ..issuing.streams import CommStreams
from .route import MEAN, Route

__all__ = ["hfsdp_reduce_scatter_into", "hsdp_reduce_scatter_into"]


def hsdp_reduce_scatter_into(
    unsharded_grad: torch.Tensor | FlatPieces,
    out_shard: torch.Tensor,
    shard_group: dist.ProcessGroup,
    outer_group: dist.ProcessGroup | None,
    *,
    spec: ReduceSpec = MEAN,
    accumulate: bool = False,
    async_op: bool = True,
    stream: CommStreams | None = None,
    transport: SharedMemoryTransport | None = None,
    outer_reduces_output: bool = False,
    comm: ReduceScatterComm | None = None,
    after_reduce: Callable[[torch.Tensor], None] | None = None,
) -> CommHandle:
    """Two-level gradient reduction for HSDP.

    Reduce-scatter inside ``shard_group``, then all-reduce the (small) shard across
    ``outer_group``: the inter-node hop carries 1/shard_size of the bytes. With ``spec.average``
    the result is the mean over all ``shard_size * outer_size`` ranks; no outer is FSDP.
    ``outer_reduces_output``: the outer all-reduce takes the whole ``out_shard`` after this
    call's part was added to it, i.e. also earlier parts reduced only inside the shard group
    (gradient accumulation reduces across the replicas once per cycle). ``comm`` runs the
    reduce-scatter (as in ``reduce_scatter_into``); ``after_reduce`` sees the result of the
    all-reduce across the replicas (of the reduce-scatter without one), as FSDP2's hook.
    """
    inp, out, at = check_reduce_scatter(
        unsharded_grad, out_shard, shard_group, "shard_group", spec, transport
    )
    outer = None if outer_group is None else peers(outer_group, "outer_group")
    if outer is not None and outer.group is at.group:
        raise ValueError("outer_group must differ from shard_group; pass outer_group=None")
    side_stream(stream, "reduce_scatter", out.device)
    if comm is not None:
        check_comm(comm, "comm")
    return Route.over(at).hsdp_reduce_scatter_into(
        inp,
        out,
        None if outer is None else Route.over(outer),
        spec=spec,
        accumulate=bool(accumulate),
        stream=stream,
        outer_reduces_output=outer_reduces_output,
        comm=comm,
        after_reduce=after_reduce,
        async_op=async_op,
    )


def hfsdp_reduce_scatter_into(
    unsharded_grad: torch.Tensor | FlatPieces,
    out_sub_shard: torch.Tensor,
    shard_group: dist.ProcessGroup,
    outer_group: dist.ProcessGroup,
    *,
    partial: torch.Tensor,
    partial_accumulate: bool = False,
    spec: ReduceSpec = MEAN,
    accumulate: bool = False,
    async_op: bool = True,
    stream: CommStreams | None = None,
    transport: SharedMemoryTransport | None = None,
    outer_transport: SharedMemoryTransport | None = None,
) -> CommHandle:
    """Two-level reduce-scatter for HFSDP: gradients end sharded across both groups.

    Reduce-scatter ``unsharded_grad`` inside ``shard_group`` into ``partial`` (this rank's
    1/shard_size slice; with ``partial_accumulate`` added to what it holds: the micro-batches
    a ``no_sync`` kept inside the shard group), then reduce-scatter ``partial`` across
    ``outer_group`` into ``out_sub_shard`` (its 1/outer_size slice, stored or added with
    ``accumulate``). With ``spec.average`` the result is the mean over all ranks of both
    groups; ``spec``'s scales apply to the inner level (``pre_scale`` to what is sent,
    ``post_scale`` to its result) and ``reduce_dtype`` to both levels. ``transport`` carries
    the inner level and ``outer_transport`` the outer one (the shared-memory transports of
    the two groups).
    """
    inp, part, at = check_reduce_scatter(
        unsharded_grad, partial, shard_group, "shard_group", spec, transport, out_arg="partial"
    )
    out = check_flat(out_sub_shard, "out_sub_shard")
    check_same_device(out, "out_sub_shard", part, "partial")
    outer = peers(outer_group, "outer_group", outer_transport)
    if outer.group is at.group:
        raise ValueError("outer_group must differ from shard_group; use reduce_scatter_into")
    check_shard_sizes(part.numel(), "partial", out, "out_sub_shard", outer.size)
    if overlaps(part, out):
        raise ValueError("partial and out_sub_shard overlap; pass separate tensors")
    side_stream(stream, "reduce_scatter", out.device)
    return Route.over(at).hfsdp_reduce_scatter_into(
        inp,
        out,
        Route.over(outer),
        spec=spec,
        partial=part,
        partial_accumulate=bool(partial_accumulate),
        accumulate=bool(accumulate),
        stream=stream,
        async_op=async_op,
    )
