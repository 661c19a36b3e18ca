"""Hierarchical (HSDP) gradient reduction: inside the shard group, then across replicas."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

from mfsdp_buffers import FlatPieces

from ._compat import Work, all_reduce_async
from ._launch import launch
from ._op_args import (
    check_reduce_scatter,
    host_route,
    membership,
    side_stream,
)
from ._reduce import ReduceSpec, finish_into, reduce_op
from .handle import CommHandle
from .naming import group_name
from .ops import ReduceScatterStage, reduce_scatter_into
from .shm import SharedMemoryTransport
from .streams import CommStreams
from .tracer import record_comm

__all__ = ["hsdp_reduce_scatter_into"]


def hsdp_reduce_scatter_into(
    unsharded_grad: torch.Tensor | FlatPieces,
    out_shard: torch.Tensor,
    shard_group: dist.ProcessGroup,
    outer_group: dist.ProcessGroup | None,
    *,
    average: bool = True,
    pre_scale: float | None = None,
    post_scale: float | None = None,
    reduce_dtype: torch.dtype | None = None,
    accumulate: bool = False,
    async_op: bool = True,
    stream: CommStreams | None = None,
    transport: SharedMemoryTransport | None = None,
    outer_reduces_output: bool = False,
) -> CommHandle:
    """Two-level gradient reduction for HSDP.

    Reduce-scatter inside ``shard_group``, then all-reduce the (small) shard across
    ``outer_group``: the inter-node hop carries 1/shard_size of the bytes. With ``average``
    the result is the mean over all ``shard_size * outer_size`` ranks; no outer is FSDP.
    ``outer_reduces_output``: the outer all-reduce takes the whole ``out_shard`` after this
    call's part was added to it, i.e. also earlier parts reduced only inside the shard group
    (gradient accumulation reduces across the replicas once per cycle).
    """
    if outer_group is None:
        return reduce_scatter_into(
            unsharded_grad,
            out_shard,
            shard_group,
            average=average,
            pre_scale=pre_scale,
            post_scale=post_scale,
            reduce_dtype=reduce_dtype,
            accumulate=accumulate,
            async_op=async_op,
            stream=stream,
            transport=transport,
        )
    args = check_reduce_scatter(
        unsharded_grad,
        out_shard,
        shard_group,
        "shard_group",
        average=average,
        pre_scale=pre_scale,
        post_scale=post_scale,
        reduce_dtype=reduce_dtype,
    )
    inp, out, shard_group, spec, numel = args.inp, args.out, args.group, args.spec, args.numel
    outer_group, _, _ = membership(outer_group, "outer_group")
    if outer_group is shard_group:
        raise ValueError("outer_group must differ from shard_group; pass outer_group=None")
    rs_side = side_stream(stream, "reduce_scatter", out.device)
    outer_side = side_stream(stream, "outer", out.device)
    if out.numel() == 0:
        return CommHandle.completed()
    rs_op, rs_factor = reduce_op(shard_group, spec.average)
    record_comm("reduce_scatter", group_name(shard_group), numel, spec.reduce_dtype)
    record_comm("all_reduce", group_name(outer_group), out.numel(), spec.reduce_dtype)
    route = host_route(transport, shard_group, out)
    stage = ReduceScatterStage(inp, out, spec, shard_group, rs_op, bool(accumulate), route)
    outer = _OuterStage(stage, out, outer_group, spec, rs_factor, bool(accumulate))
    run_outer, finish = outer.of_output if outer_reduces_output else outer.of_part
    return launch(
        [(rs_side, stage), (outer_side, run_outer)],
        device=out.device,
        finish=finish,
        async_op=async_op,
        keep_alive=(inp, out),
        reads=inp.pieces if isinstance(inp, FlatPieces) else (inp,),
        writes=(out,),
        label=f"HSDP reduce_scatter on groups {group_name(shard_group)}, {group_name(outer_group)}",
    )


class _OuterStage:
    """The all-reduce across the replicas, and the finish that lands the result in ``out``."""

    def __init__(
        self,
        inner: ReduceScatterStage,
        out: torch.Tensor,
        group: dist.ProcessGroup,
        spec: ReduceSpec,
        inner_factor: float,
        accumulate: bool,
    ) -> None:
        self._inner, self._out, self._group, self._accumulate = inner, out, group, accumulate
        self._op, self._outer_factor = reduce_op(group, spec.average)
        post = spec.post_scale if spec.post_scale is not None else 1.0
        self._inner_factor = inner_factor * post

    @property
    def of_part(self) -> tuple[Callable[[], Work | None], Callable[[], None]]:
        """All-reduce this call's reduce-scattered part, then add it into ``out``."""

        def run() -> Work | None:
            return all_reduce_async(self._inner.result(), self._op, self._group)

        def finish() -> None:
            factor = self._inner_factor * self._outer_factor
            finish_into(self._inner.result(), self._out, factor=factor, accumulate=self._accumulate)

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
            if self._outer_factor != 1.0:
                with torch.no_grad():
                    self._out.mul_(self._outer_factor)

        return run, finish
