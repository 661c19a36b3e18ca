"""A group's collectives, issued: ``Route``, where every collective of flat buffers goes out.

The public ops check every argument on every call, then issue through a ``Route``; an engine
checks its buffers where it lays them out and its group and transport once, when it builds
its ``Route``, whose ops check nothing again (the package README's paragraph "Every op
validates its arguments locally").
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

from mfsdp_buffers import FlatPieces

from ..comms.custom_comms import AllGatherComm, ReduceScatterComm, custom_all_gather
from ..core._compat import Work, all_reduce_async
from ..core.naming import group_name
from ..host.shm import SharedMemoryTransport
from ..issuing._op_args import Peers, peers, routed_reduce_op, side_of
from ..issuing._reduce import ReduceSpec, Reduction, finish_into, prepare_input
from ..issuing.handle import CommHandle
from ..issuing.stages import Stage, issue_stages
from ..issuing.streams import CommStreams
from ..tracing.tracer import record_comm
from .coalescing import GatherRoute, issue_all_gather, queued_gathers
from .reduce_stages import OuterStage, ReduceScatterStage

__all__ = ["MEAN", "Route"]

MEAN = ReduceSpec()
"""The default reduction: the mean over the group, in the input's dtype, unscaled."""

_GRAD = "unsharded_grad"  # the name a reduction's input has in errors (as the public ops)


class Route:
    """The collectives over ``group`` (carried by ``transport`` for CPU tensors, or c10d).

    Built once per group (membership and the transport's group checked here, raising as the
    public ops do); each op then trusts its tensors to be flat, contiguous, on one device and
    dtype, and sized for the group, and its ``stream`` and ``comm`` to be checked."""

    def __init__(
        self, group: dist.ProcessGroup, transport: SharedMemoryTransport | None = None
    ) -> None:
        self.peers: Peers = peers(group, "group", transport)

    @classmethod
    def over(cls, at: Peers) -> Route:
        """The route over ``at``: a group (and transport) the caller checked itself."""
        route = cls.__new__(cls)
        route.peers = at
        return route

    @property
    def group(self) -> dist.ProcessGroup:
        return self.peers.group

    @property
    def rank(self) -> int:
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
        if shard.numel() == 0:
            return CommHandle.completed()
        at, side = self.peers, side_of(stream, "all_gather")
        if comm is not None:
            return custom_all_gather(
                shard, unsharded, at.group, at.rank, comm, side=side, async_op=async_op
            )
        route = GatherRoute(at.group, at.size, at.carrier(shard), side)
        queues = queued_gathers()
        if queues is not None and async_op:  # inside coalesced_gathers(): issued with others
            return queues.add(shard, unsharded, route)
        return issue_all_gather([(shard, unsharded)], route, async_op=async_op)

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
        reduction = spec.resolve(unsharded_grad.dtype, _GRAD)  # it may change between steps
        inp, out, at = unsharded_grad, out_shard, self.peers
        if out.numel() == 0:
            return CommHandle.completed()
        group = at.group
        alone = comm is None and at.size == 1  # no collective, as FSDP2 at world size 1
        route = None if comm is not None or alone else at.carrier(out)
        op, factor = routed_reduce_op(route, group, reduction)
        factor *= reduction.post_scale if reduction.post_scale is not None else 1.0
        if not alone:
            record_comm("reduce_scatter", group_name(group), _numel(inp), reduction.reduce_dtype)
        stage = ReduceScatterStage(
            inp, out, reduction, group, op, accumulate, route, comm, alone=alone
        )

        def finish() -> None:
            result = stage.result()
            if after_reduce is not None:
                after_reduce(result)
            finish_into(result, out, factor=factor, accumulate=accumulate)

        label = f"reduce_scatter on group {group_name(group)}"
        stages: list[Stage] = [(side_of(stream, "reduce_scatter"), stage)]
        return _issue_reduction(stages, inp, (out,), finish, async_op=async_op, label=label)

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
        reduction = spec.resolve(tensor.dtype, "tensor")
        if tensor.numel() == 0:
            return CommHandle.completed()
        group, size = self.group, self.size
        op, factor = routed_reduce_op(None, group, reduction)
        factor *= reduction.post_scale if reduction.post_scale is not None else 1.0
        if size > 1:  # one rank: the reduction is the tensor itself, no collective
            record_comm(record_as, group_name(group), tensor.numel(), reduction.reduce_dtype)
        sent: list[torch.Tensor] = []

        def issue() -> Work | None:
            sent.append(prepare_input(tensor, reduction))
            return all_reduce_async(sent[0], op, group) if size > 1 else None

        stages: list[Stage] = [(side_of(stream, "reduce_scatter"), issue)]
        if outer is not None:
            outer_group = outer.group
            outer_op, outer_factor = routed_reduce_op(None, outer_group, reduction)
            factor *= outer_factor
            record_comm(record_as, group_name(outer_group), tensor.numel(), reduction.reduce_dtype)
            stages.append(
                (side_of(stream, "outer"), lambda: all_reduce_async(sent[0], outer_op, outer_group))
            )

        def finish() -> None:
            result = sent.pop()
            if after_reduce is not None:
                after_reduce(result)
            finish_into(result, tensor, factor=factor, accumulate=False)

        return issue_stages(
            stages,
            device=tensor.device,
            finish=finish,
            async_op=async_op,
            keep_alive=(tensor,),
            reads=(tensor,),
            writes=(tensor,),
            label=f"all_reduce on group {group_name(group)}",
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
        reduction = spec.resolve(unsharded_grad.dtype, _GRAD)
        inp, out = unsharded_grad, out_shard
        if out.numel() == 0:
            return CommHandle.completed()
        shard_group, outer_group = self.group, outer.group
        rs_op, rs_factor = routed_reduce_op(None, shard_group, reduction)
        record_comm("reduce_scatter", group_name(shard_group), _numel(inp), reduction.reduce_dtype)
        record_comm("all_reduce", group_name(outer_group), out.numel(), reduction.reduce_dtype)
        route = None if comm is not None else self.peers.carrier(out)
        stage = ReduceScatterStage(inp, out, reduction, shard_group, rs_op, accumulate, route, comm)
        across = OuterStage(stage, out, outer_group, reduction, rs_factor, accumulate)
        across.after_reduce = after_reduce
        run_outer, finish = across.of_output if outer_reduces_output else across.of_part
        label = f"HSDP reduce_scatter on {group_name(shard_group)}, {group_name(outer_group)}"
        stages: list[Stage] = [
            (side_of(stream, "reduce_scatter"), stage),
            (side_of(stream, "outer"), run_outer),
        ]
        return _issue_reduction(stages, inp, (out,), finish, async_op=async_op, label=label)

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
        reduction = spec.resolve(unsharded_grad.dtype, _GRAD)
        inp, out = unsharded_grad, out_sub_shard
        if out.numel() == 0:
            return CommHandle.completed()
        shard_group, outer_group = self.group, outer.group
        route = self.peers.carrier(partial)
        inner_op, inner_factor = routed_reduce_op(route, shard_group, reduction)
        inner_factor *= reduction.post_scale if reduction.post_scale is not None else 1.0
        outer_route = outer.peers.carrier(out)
        outer_op, outer_factor = routed_reduce_op(outer_route, outer_group, reduction)
        record_comm("reduce_scatter", group_name(shard_group), _numel(inp), reduction.reduce_dtype)
        record_comm(
            "reduce_scatter", group_name(outer_group), partial.numel(), reduction.reduce_dtype
        )
        inner_stage = ReduceScatterStage(
            inp, partial, reduction, shard_group, inner_op, partial_accumulate, route
        )
        outer_spec = Reduction(reduction.average, None, None, reduction.reduce_dtype)
        outer_stage = ReduceScatterStage(
            partial, out, outer_spec, outer_group, outer_op, accumulate, outer_route
        )

        def run_outer() -> Work | None:
            finish_into(
                inner_stage.result(), partial, factor=inner_factor, accumulate=partial_accumulate
            )
            return outer_stage()

        def finish() -> None:
            finish_into(outer_stage.result(), out, factor=outer_factor, accumulate=accumulate)

        label = f"HFSDP reduce_scatter on {group_name(shard_group)}, {group_name(outer_group)}"
        stages: list[Stage] = [
            (side_of(stream, "reduce_scatter"), inner_stage),
            (side_of(stream, "outer"), run_outer),
        ]
        return _issue_reduction(stages, inp, (partial, out), finish, async_op=async_op, label=label)


def _numel(inp: torch.Tensor | FlatPieces) -> int:
    return inp.numel if isinstance(inp, FlatPieces) else inp.numel()


def _issue_reduction(
    stages: list[Stage],
    inp: torch.Tensor | FlatPieces,
    outs: tuple[torch.Tensor, ...],
    finish: Callable[[], None],
    *,
    async_op: bool,
    label: str,
) -> CommHandle:
    """Issue a gradient reduction's ``stages``: it reads ``inp`` (each of its pieces) and
    writes ``outs``, the last of them its result, all kept alive until it landed."""
    return issue_stages(
        stages,
        device=outs[-1].device,
        finish=finish,
        async_op=async_op,
        keep_alive=(inp, *outs),
        reads=inp.pieces if isinstance(inp, FlatPieces) else (inp,),
        writes=outs,
        label=label,
    )
