"""The stages a reduction issues: the reduce-scatter inside a group, and for HSDP the
all-reduce of its result across the replicas (``Route`` issues them, in order)."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

from mfsdp_buffers import FlatPieces

from ..comms.custom_comms import ReduceScatterComm, allocate_flat, uses_caller_buffers
from ..core._checks import overlaps
from ..core._compat import Work, all_reduce_async, reduce_scatter_single
from ..host.shm import SharedMemoryTransport
from ..issuing._reduce import Reduction, finish_into, prepare_input, reduce_op

__all__ = ["OuterStage", "ReduceScatterStage"]


class ReduceScatterStage:
    """Stage 1 of a (possibly hierarchical) reduce-scatter; holds its tensors. The receive
    tensor is chosen when the stage runs, so on a side stream a temporary is allocated there."""

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


class OuterStage:
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
