"""Async collectives on flat buffers: the only way upper layers communicate.

Each op validates every argument locally first (so a mistake raises on the
calling rank instead of hanging the others), records itself with the tracer,
issues the collective (on a side stream when given active ``CommStreams``) and
returns a ``CommHandle`` whose ``wait()`` also runs the post-processing. The issuing half
of each op (``gather_checked``, ``reduce_scatter_checked``, ``all_reduce_checked``) is shared
with ``Route``, whose arguments were checked once, where an engine built its buffers.
Results are the collective's semantics exactly; see ``_reduce`` for the
reduction rules (average in the collective, one copy at most, direct output), and
``coalescing`` for all-gathers queued to go out as one collective.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

from mfsdp_buffers import FlatPieces

from ..comms.custom_comms import (
    AllGatherComm,
    ReduceScatterComm,
    allocate_flat,
    check_comm,
    custom_all_gather,
    uses_caller_buffers,
)
from ..core._checks import (
    check_flat,
    check_same_device,
    overlaps,
)
from ..core._compat import (
    Work,
    all_reduce_async,
    broadcast_from_group_rank,
    reduce_scatter_single,
)
from ..core.naming import group_name
from ..host.shm import SharedMemoryTransport
from ..issuing._op_args import (
    Peers,
    check_reduce_scatter,
    check_shard_sizes,
    membership,
    peers,
    reduce_spec,
    routed_reduce_op,
    side_of,
    side_stream,
)
from ..issuing._reduce import ReduceSpec, Reduction, finish_into, prepare_input, reduce_op
from ..issuing.handle import CommHandle
from ..issuing.stages import Stage, issue_stages
from ..issuing.streams import CommStreams
from ..safety.liveness import naming_dead_peers
from ..tracing.tracer import record_comm
from .coalescing import GatherRoute, issue_all_gather, queued_gathers

__all__ = [
    "all_gather_into",
    "all_reduce_",
    "broadcast_",
    "reduce_scatter_into",
]

MEAN = ReduceSpec()
"""The default reduction: the mean over the group, in the input's dtype, unscaled."""


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
    """Gather every rank's ``shard`` straight into ``unsharded`` (no staging copy).

    ``shard`` may be this rank's own slot of ``unsharded`` (in-place gather). ``transport``
    (from ``enable_host_transport``) carries it over shared memory; otherwise c10d does.
    ``comm`` (FSDP2's ``AllGather`` protocol, ``custom_comms``) runs it instead, in a buffer
    of its own, never coalesced.
    """
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
    return gather_checked(shard, unsharded, at, stream=stream, comm=comm, async_op=async_op)


def gather_checked(
    shard: torch.Tensor,
    unsharded: torch.Tensor,
    at: Peers,
    *,
    stream: CommStreams | None,
    comm: AllGatherComm | None,
    async_op: bool,
) -> CommHandle:
    """``all_gather_into`` once its arguments were checked (by it, or once by a ``Route``)."""
    if shard.numel() == 0:
        return CommHandle.completed()
    side = side_of(stream, "all_gather")
    if comm is not None:
        return custom_all_gather(
            shard, unsharded, at.group, at.rank, comm, side=side, async_op=async_op
        )
    route = GatherRoute(at.group, at.size, at.carrier(shard), side)
    queues = queued_gathers()
    if queues is not None and async_op:  # inside coalesced_gathers(): issued with others
        return queues.add(shard, unsharded, route)
    return issue_all_gather([(shard, unsharded)], route, async_op=async_op)


class ReduceScatterStage:
    """Stage 1 of a (possibly hierarchical) reduce-scatter; holds its tensors.

    The receive tensor is chosen only when the stage runs, so that on a side
    stream any temporary is allocated on that stream.
    """

    def __init__(
        self,
        inp: torch.Tensor | FlatPieces,
        out: torch.Tensor,
        spec: Reduction,
        group: dist.ProcessGroup,
        op: dist.ReduceOp.RedOpType,
        accumulate: bool,
        transport: SharedMemoryTransport | None = None,
        comm: ReduceScatterComm | None = None,
        alone: bool = False,
    ) -> None:
        """``alone``: the group has one rank, and no ``comm``: the reduction is the input
        itself, copied locally (no collective, as FSDP2 at world size 1)."""
        self.inp, self.out, self.spec = inp, out, spec
        self.group, self.op, self.accumulate = group, op, accumulate
        self.transport = None if alone else transport
        self.comm = comm
        self.alone = alone
        self.recv: torch.Tensor | None = None
        self.send: torch.Tensor | FlatPieces | None = None

    def _send(self) -> torch.Tensor | FlatPieces:
        """What goes on the wire: pieces stay pieces only where the transport reads them."""
        inp = self.inp
        if isinstance(inp, FlatPieces):
            reads_in_place = self.transport is not None and self.spec.pre_scale is None
            if reads_in_place and inp.dtype == self.spec.reduce_dtype:
                return inp
            inp = inp.materialize()
        return prepare_input(inp, self.spec)

    def __call__(self) -> Work | None:
        transport = self.transport
        send = self._send()
        sent = send.pieces if isinstance(send, FlatPieces) else [send]
        direct = (
            not self.accumulate
            and self.out.dtype == self.spec.reduce_dtype
            and not any(overlaps(self.out, t) for t in sent)
        )
        recv = (
            self.out
            if direct or self.comm is not None
            else self.out.new_empty(self.out.shape, dtype=self.spec.reduce_dtype)
        )
        self.send, self.recv = send, recv
        if self.alone:
            assert isinstance(send, torch.Tensor)
            if send.data_ptr() != recv.data_ptr():
                recv.copy_(send)
            return None
        if self.comm is not None:
            assert isinstance(send, torch.Tensor)
            # the output buffer is the comm's (finish copies it out), unless the comm takes
            # ours and the output can be written in place
            if not (direct and uses_caller_buffers(self.comm)):
                self.recv = allocate_flat(self.comm, self.out.numel(), recv.dtype, recv.device)
            return self.comm(
                output_tensor=self.recv,
                input_tensor=send,
                group=self.group,
                op=self.op,
                async_op=True,
            )
        if transport is not None:
            return transport.reduce_scatter(recv, send, average=self.op == dist.ReduceOp.AVG)
        assert isinstance(send, torch.Tensor)
        return reduce_scatter_single(recv, send, self.op, self.group, async_op=True)

    def result(self) -> torch.Tensor:
        assert self.recv is not None, "stage has not run"
        self.send = None
        return self.recv


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
    args = check_reduce_scatter(unsharded_grad, out_shard, group, "group", spec, transport)
    side_stream(stream, "reduce_scatter", args.out.device)
    if comm is not None:
        check_comm(comm, "comm")
    return reduce_scatter_checked(
        args.inp,
        args.out,
        args.at,
        args.spec,
        stream=stream,
        accumulate=bool(accumulate),
        comm=comm,
        after_reduce=after_reduce,
        async_op=async_op,
    )


def reduce_scatter_checked(
    inp: torch.Tensor | FlatPieces,
    out: torch.Tensor,
    at: Peers,
    reduction: Reduction,
    *,
    stream: CommStreams | None,
    accumulate: bool,
    comm: ReduceScatterComm | None,
    after_reduce: Callable[[torch.Tensor], None] | None,
    async_op: bool,
) -> CommHandle:
    """``reduce_scatter_into`` once its arguments were checked (by it, or once by a
    ``Route``): ``reduction`` is its ``spec`` resolved for ``inp``."""
    if out.numel() == 0:
        return CommHandle.completed()
    group = at.group
    numel = inp.numel if isinstance(inp, FlatPieces) else inp.numel()
    alone = comm is None and at.size == 1  # no collective, as FSDP2 at world size 1
    route = None if comm is not None or alone else at.carrier(out)
    op, factor = routed_reduce_op(route, group, reduction)
    factor *= reduction.post_scale if reduction.post_scale is not None else 1.0
    if not alone:
        record_comm("reduce_scatter", group_name(group), numel, reduction.reduce_dtype)
    stage = ReduceScatterStage(inp, out, reduction, group, op, accumulate, route, comm, alone=alone)

    def finish() -> None:
        result = stage.result()
        if after_reduce is not None:
            after_reduce(result)
        finish_into(result, out, factor=factor, accumulate=accumulate)

    return issue_stages(
        [(side_of(stream, "reduce_scatter"), stage)],
        device=out.device,
        finish=finish,
        async_op=async_op,
        keep_alive=(inp, out),
        reads=inp.pieces if isinstance(inp, FlatPieces) else (inp,),
        writes=(out,),
        label=f"reduce_scatter on group {group_name(group)}",
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
    reduction = reduce_spec(tensor, "tensor", spec)
    side_stream(stream, "reduce_scatter", tensor.device)  # checks the stream's device
    return all_reduce_checked(
        tensor,
        at,
        outer,
        reduction,
        stream=stream,
        after_reduce=after_reduce,
        record_as=record_as,
        async_op=async_op,
    )


def all_reduce_checked(
    tensor: torch.Tensor,
    at: Peers,
    outer: Peers | None,
    reduction: Reduction,
    *,
    stream: CommStreams | None,
    after_reduce: Callable[[torch.Tensor], None] | None,
    record_as: str,
    async_op: bool,
) -> CommHandle:
    """``all_reduce_`` once its arguments were checked (by it, or once by a ``Route``):
    ``reduction`` is its ``spec`` resolved for ``tensor``."""
    if tensor.numel() == 0:
        return CommHandle.completed()
    group, size = at.group, at.size
    op, factor = reduce_op(group, reduction.average, sum_only=reduction.sum_only)
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
        outer_op, outer_factor = reduce_op(
            outer_group, reduction.average, sum_only=reduction.sum_only
        )
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
        broadcast_from_group_rank(tensor, src, group)
