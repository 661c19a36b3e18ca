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
from ..core._compat import Work, all_reduce_async
from ..core.naming import group_name
from ..host.shm import SharedMemoryTransport
from ..issuing._op_args import (
    Peers,
    check_reduce_scatter,
    check_shard_sizes,
    peers,
    routed_reduce_op,
    side_of,
    side_stream,
)
from ..issuing._reduce import ReduceSpec, Reduction, finish_into, reduce_op
from ..issuing.handle import CommHandle
from ..issuing.stages import issue_stages
from ..issuing.streams import CommStreams
from ..tracing.tracer import record_comm
from .flat_ops import MEAN, ReduceScatterStage, reduce_scatter_into

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
    if outer_group is None:
        return reduce_scatter_into(
            unsharded_grad,
            out_shard,
            shard_group,
            spec=spec,
            accumulate=accumulate,
            async_op=async_op,
            stream=stream,
            transport=transport,
            comm=comm,
            after_reduce=after_reduce,
        )
    args = check_reduce_scatter(
        unsharded_grad, out_shard, shard_group, "shard_group", spec, transport
    )
    outer = peers(outer_group, "outer_group")
    if outer.group is args.at.group:
        raise ValueError("outer_group must differ from shard_group; pass outer_group=None")
    side_stream(stream, "reduce_scatter", args.out.device)
    if comm is not None:
        check_comm(comm, "comm")
    return hsdp_reduce_scatter_checked(
        args.inp,
        args.out,
        args.at,
        outer,
        args.spec,
        accumulate=bool(accumulate),
        stream=stream,
        outer_reduces_output=outer_reduces_output,
        comm=comm,
        after_reduce=after_reduce,
        async_op=async_op,
    )


def hsdp_reduce_scatter_checked(
    inp: torch.Tensor | FlatPieces,
    out: torch.Tensor,
    at: Peers,
    outer_at: Peers,
    reduction: Reduction,
    *,
    accumulate: bool,
    stream: CommStreams | None,
    outer_reduces_output: bool,
    comm: ReduceScatterComm | None,
    after_reduce: Callable[[torch.Tensor], None] | None,
    async_op: bool,
) -> CommHandle:
    """``hsdp_reduce_scatter_into`` with an outer group, once its arguments were checked (by
    it, or once by a ``Route``): ``reduction`` is its ``spec`` resolved for ``inp``."""
    if out.numel() == 0:
        return CommHandle.completed()
    shard_group, outer_group = at.group, outer_at.group
    numel = inp.numel if isinstance(inp, FlatPieces) else inp.numel()
    rs_op, rs_factor = reduce_op(shard_group, reduction.average, sum_only=reduction.sum_only)
    record_comm("reduce_scatter", group_name(shard_group), numel, reduction.reduce_dtype)
    record_comm("all_reduce", group_name(outer_group), out.numel(), reduction.reduce_dtype)
    route = None if comm is not None else at.carrier(out)
    stage = ReduceScatterStage(inp, out, reduction, shard_group, rs_op, accumulate, route, comm)
    outer = _OuterStage(stage, out, outer_group, reduction, rs_factor, accumulate)
    outer.after_reduce = after_reduce
    run_outer, finish = outer.of_output if outer_reduces_output else outer.of_part
    return issue_stages(
        [(side_of(stream, "reduce_scatter"), stage), (side_of(stream, "outer"), run_outer)],
        device=out.device,
        finish=finish,
        async_op=async_op,
        keep_alive=(inp, out),
        reads=inp.pieces if isinstance(inp, FlatPieces) else (inp,),
        writes=(out,),
        label=f"HSDP reduce_scatter on groups {group_name(shard_group)}, {group_name(outer_group)}",
    )


class _OuterStage:
    """The all-reduce across the replicas, and the finish that lands the result in ``out``
    (``after_reduce`` sees the all-reduced tensor first)."""

    after_reduce: Callable[[torch.Tensor], None] | None = None

    def __init__(
        self,
        inner: ReduceScatterStage,
        out: torch.Tensor,
        group: dist.ProcessGroup,
        spec: Reduction,
        inner_factor: float,
        accumulate: bool,
    ) -> None:
        self._inner, self._out, self._group, self._accumulate = inner, out, group, accumulate
        self._op, self._outer_factor = reduce_op(group, spec.average, sum_only=spec.sum_only)
        post = spec.post_scale if spec.post_scale is not None else 1.0
        self._inner_factor = inner_factor * post

    @property
    def of_part(self) -> tuple[Callable[[], Work | None], Callable[[], None]]:
        """All-reduce this call's reduce-scattered part, then add it into ``out``."""

        def run() -> Work | None:
            return all_reduce_async(self._inner.result(), self._op, self._group)

        def finish() -> None:
            factor = self._inner_factor * self._outer_factor
            result = self._inner.result()
            if self.after_reduce is not None:
                self.after_reduce(result)
            finish_into(result, self._out, factor=factor, accumulate=self._accumulate)

        return run, finish

    @property
    def of_output(self) -> tuple[Callable[[], Work | None], Callable[[], None]]:
        """Add this call's part into ``out``, then all-reduce the whole of ``out``."""

        def run() -> Work | None:
            finish_into(
                self._inner.result(),
                self._out,
                factor=self._inner_factor,
                accumulate=self._accumulate,
            )
            return all_reduce_async(self._out, self._op, self._group)

        def finish() -> None:
            if self.after_reduce is not None:
                self.after_reduce(self._out)
            if self._outer_factor != 1.0:
                with torch.no_grad():
                    self._out.mul_(self._outer_factor)

        return run, finish


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
    args = check_reduce_scatter(
        unsharded_grad, partial, shard_group, "shard_group", spec, transport, out_arg="partial"
    )
    out = check_flat(out_sub_shard, "out_sub_shard")
    check_same_device(out, "out_sub_shard", args.out, "partial")
    outer = peers(outer_group, "outer_group", outer_transport)
    if outer.group is args.at.group:
        raise ValueError("outer_group must differ from shard_group; use reduce_scatter_into")
    check_shard_sizes(args.out.numel(), "partial", out, "out_sub_shard", outer.size)
    if overlaps(args.out, out):
        raise ValueError("partial and out_sub_shard overlap; pass separate tensors")
    side_stream(stream, "reduce_scatter", out.device)
    return hfsdp_reduce_scatter_checked(
        args.inp,
        out,
        args.at,
        outer,
        args.spec,
        partial=args.out,
        partial_accumulate=bool(partial_accumulate),
        accumulate=bool(accumulate),
        stream=stream,
        async_op=async_op,
    )


def hfsdp_reduce_scatter_checked(
    inp: torch.Tensor | FlatPieces,
    out: torch.Tensor,
    at: Peers,
    outer_at: Peers,
    reduction: Reduction,
    *,
    partial: torch.Tensor,
    partial_accumulate: bool,
    accumulate: bool,
    stream: CommStreams | None,
    async_op: bool,
) -> CommHandle:
    """``hfsdp_reduce_scatter_into`` once its arguments were checked (by it, or once by a
    ``Route``): ``reduction`` is its ``spec`` resolved for ``inp``."""
    if out.numel() == 0:
        return CommHandle.completed()
    shard_group, outer_group = at.group, outer_at.group
    numel = inp.numel if isinstance(inp, FlatPieces) else inp.numel()
    route = at.carrier(partial)
    inner_op, inner_factor = routed_reduce_op(route, shard_group, reduction)
    inner_factor *= reduction.post_scale if reduction.post_scale is not None else 1.0
    outer_route = outer_at.carrier(out)
    outer_op, outer_factor = routed_reduce_op(outer_route, outer_group, reduction)
    record_comm("reduce_scatter", group_name(shard_group), numel, reduction.reduce_dtype)
    record_comm("reduce_scatter", group_name(outer_group), partial.numel(), reduction.reduce_dtype)
    inner = ReduceScatterStage(
        inp, partial, reduction, shard_group, inner_op, partial_accumulate, route
    )
    outer_spec = Reduction(reduction.average, None, None, reduction.reduce_dtype)
    outer = ReduceScatterStage(
        partial, out, outer_spec, outer_group, outer_op, accumulate, outer_route
    )

    def run_outer() -> Work | None:
        finish_into(inner.result(), partial, factor=inner_factor, accumulate=partial_accumulate)
        return outer()

    def finish() -> None:
        finish_into(outer.result(), out, factor=outer_factor, accumulate=accumulate)

    return issue_stages(
        [(side_of(stream, "reduce_scatter"), inner), (side_of(stream, "outer"), run_outer)],
        device=out.device,
        finish=finish,
        async_op=async_op,
        keep_alive=(inp, partial, out),
        reads=inp.pieces if isinstance(inp, FlatPieces) else (inp,),
        writes=(partial, out),
        label=f"HFSDP reduce_scatter on {group_name(shard_group)}, {group_name(outer_group)}",
    )
