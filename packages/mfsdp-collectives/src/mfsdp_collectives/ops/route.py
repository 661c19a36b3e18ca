"""A group's collectives, checked once: ``Route``.

The public ops (``all_gather_into``, ``reduce_scatter_into``, ...) check every argument on
every call, so that a mistake raises on the calling rank instead of hanging the others. An
engine lays its buffers out once and then issues the same collectives on them every step: it
checks its buffers where it builds them (their layout fixes sizes, dtype and device for the
group), and the group and transport once, in a ``Route``, whose ops check nothing again.
They issue exactly what the public ops issue (the same issuing code, the same counts and
bytes); what varies per call and is not an argument is still decided per call: whether the
transport was closed since, and on which side stream each stage runs.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

from mfsdp_buffers import FlatPieces

from ..comms.custom_comms import AllGatherComm, ReduceScatterComm
from ..host.shm import SharedMemoryTransport
from ..issuing._op_args import Peers, peers
from ..issuing._reduce import ReduceSpec
from ..issuing.handle import CommHandle
from ..issuing.streams import CommStreams
from .flat_ops import MEAN, all_reduce_checked, gather_checked, reduce_scatter_checked
from .hsdp_ops import hfsdp_reduce_scatter_checked, hsdp_reduce_scatter_checked

__all__ = ["Route"]

_GRAD = "unsharded_grad"  # the name a reduction's input has in errors (as the public ops)


class Route:
    """The collectives over ``group`` (carried by ``transport`` for CPU tensors, or c10d),
    for a caller that checked its tensors once where it built them.

    Built once per group (this rank's membership and the transport's group checked here,
    raising as the public ops do); each op then trusts its tensors to be flat, contiguous,
    on one device and dtype, and sized for the group (the shard ``1/size`` of the whole),
    as the public op of the same name would have checked, and its ``stream`` and ``comm`` to
    be those the caller checked when it was given them.
    """

    def __init__(
        self, group: dist.ProcessGroup, transport: SharedMemoryTransport | None = None
    ) -> None:
        self.peers: Peers = peers(group, "group", transport)

    @property
    def group(self) -> dist.ProcessGroup:
        return self.peers.group

    @property
    def rank(self) -> int:
        """This rank's index in the group."""
        return self.peers.rank

    @property
    def size(self) -> int:
        return self.peers.size

    def all_gather_into(
        self,
        shard: torch.Tensor,
        unsharded: torch.Tensor,
        *,
        stream: CommStreams | None = None,
        comm: AllGatherComm | None = None,
        async_op: bool = True,
    ) -> CommHandle:
        """``mfsdp_collectives.all_gather_into`` over this route."""
        return gather_checked(
            shard, unsharded, self.peers, stream=stream, comm=comm, async_op=async_op
        )

    def reduce_scatter_into(
        self,
        unsharded_grad: torch.Tensor | FlatPieces,
        out_shard: torch.Tensor,
        *,
        spec: ReduceSpec = MEAN,
        accumulate: bool = False,
        stream: CommStreams | None = None,
        comm: ReduceScatterComm | None = None,
        after_reduce: Callable[[torch.Tensor], None] | None = None,
        async_op: bool = True,
    ) -> CommHandle:
        """``mfsdp_collectives.reduce_scatter_into`` over this route."""
        return reduce_scatter_checked(
            unsharded_grad,
            out_shard,
            self.peers,
            spec.resolve(unsharded_grad.dtype, _GRAD),  # the spec may change between steps
            stream=stream,
            accumulate=accumulate,
            comm=comm,
            after_reduce=after_reduce,
            async_op=async_op,
        )

    def all_reduce_(
        self,
        tensor: torch.Tensor,
        *,
        spec: ReduceSpec = MEAN,
        stream: CommStreams | None = None,
        outer: Route | None = None,
        after_reduce: Callable[[torch.Tensor], None] | None = None,
        record_as: str = "all_reduce",
        async_op: bool = True,
    ) -> CommHandle:
        """``mfsdp_collectives.all_reduce_`` over this route (then across ``outer``)."""
        return all_reduce_checked(
            tensor,
            self.peers,
            None if outer is None else outer.peers,
            spec.resolve(tensor.dtype, "tensor"),
            stream=stream,
            after_reduce=after_reduce,
            record_as=record_as,
            async_op=async_op,
        )

    def hsdp_reduce_scatter_into(
        self,
        unsharded_grad: torch.Tensor | FlatPieces,
        out_shard: torch.Tensor,
        outer: Route | None,
        *,
        spec: ReduceSpec = MEAN,
        accumulate: bool = False,
        stream: CommStreams | None = None,
        outer_reduces_output: bool = False,
        comm: ReduceScatterComm | None = None,
        after_reduce: Callable[[torch.Tensor], None] | None = None,
        async_op: bool = True,
    ) -> CommHandle:
        """``mfsdp_collectives.hsdp_reduce_scatter_into`` over this route (the shard group)
        and ``outer`` (None: only this route's reduce-scatter)."""
        if outer is None:
            return self.reduce_scatter_into(
                unsharded_grad,
                out_shard,
                spec=spec,
                accumulate=accumulate,
                stream=stream,
                comm=comm,
                after_reduce=after_reduce,
                async_op=async_op,
            )
        return hsdp_reduce_scatter_checked(
            unsharded_grad,
            out_shard,
            self.peers,
            outer.peers,
            spec.resolve(unsharded_grad.dtype, _GRAD),
            accumulate=accumulate,
            stream=stream,
            outer_reduces_output=outer_reduces_output,
            comm=comm,
            after_reduce=after_reduce,
            async_op=async_op,
        )

    def hfsdp_reduce_scatter_into(
        self,
        unsharded_grad: torch.Tensor | FlatPieces,
        out_sub_shard: torch.Tensor,
        outer: Route,
        *,
        partial: torch.Tensor,
        partial_accumulate: bool = False,
        spec: ReduceSpec = MEAN,
        accumulate: bool = False,
        stream: CommStreams | None = None,
        async_op: bool = True,
    ) -> CommHandle:
        """``mfsdp_collectives.hfsdp_reduce_scatter_into`` over this route (the shard group,
        into ``partial``) and ``outer`` (into ``out_sub_shard``)."""
        return hfsdp_reduce_scatter_checked(
            unsharded_grad,
            out_sub_shard,
            self.peers,
            outer.peers,
            spec.resolve(unsharded_grad.dtype, _GRAD),
            partial=partial,
            partial_accumulate=partial_accumulate,
            accumulate=accumulate,
            stream=stream,
            async_op=async_op,
        )
