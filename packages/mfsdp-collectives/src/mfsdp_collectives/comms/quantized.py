"""Block-quantized all-gather and reduce-scatter (ZeRO++'s qwZ and qgZ), built so that
DeepSpeed's reported failures cannot happen: any size (#4852, #4386), one all-to-all summed in
fp32 in rank order, non-finite inputs raised on every rank (#6926); the package README says how.

One destination's payload: a header (int32: the sender's first non-finite index, -1 for none),
the codes (padded to 4 bytes), the block scales (fp32), then the ``ExactPositions`` values
(fp32), if any. The codec is ``block_codec``.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from typing import cast

import torch
import torch.distributed as dist

from ..core._checks import check_flat, overlaps
from ..core._compat import Work, all_gather_single
from ..core.fake import is_fake
from ..core.naming import group_name
from ..host.collective_worker import CollectiveWorker
from ..issuing._op_args import check_shard_sizes, membership
from ..tracing.tracer import record_comm
from .block_codec import (
    HEADER_BYTES,
    BlockQuantization,
    accumulate_blocks,
    check_codable,
    dequantize_blocks,
    is_finite,
    quantize_blocks,
    write_headers,
)
from .exact_values import ExactPositions
from .quantization_buffers import QuantizationBuffers
from .quantization_errors import ErrorSums

__all__ = [
    "NonFiniteError",
    "QuantizedReduction",
    "quantized_all_gather_into",
    "quantized_reduce_scatter_into",
]


ErrorReport = Callable[[ErrorSums, int], None]
"""Told the error of what one call quantized, and how many values that was."""


class NonFiniteError(FloatingPointError):
    """A rank's input to a quantized collective held inf or NaN (raised on every rank)."""

    def __init__(self, op: str, group: str, rank: int, index: int, numel: int) -> None:
        self.rank, self.index = rank, index
        super().__init__(
            f"quantized {op} on group {group}: rank {rank}'s input holds a non-finite value "
            f"at element {index} of {numel}; an inf/NaN gradient or weight cannot be "
            "quantized (find the parameter at that offset of the flat buffer, or check the "
            "loss scale)"
        )


def _raise_if_any_non_finite(
    payloads: torch.Tensor, op: str, group: dist.ProcessGroup, numel: int
) -> None:
    """Every rank holds every sender's header: all raise alike, after the collective."""
    if is_fake(payloads):  # a planning run: no values, the route of finite ones
        return
    firsts = payloads[:, :HEADER_BYTES].clone().view(torch.int32).flatten().tolist()
    for rank, first in enumerate(firsts):
        if first >= 0:
            raise NonFiniteError(op, group_name(group), rank, first, numel)


class _ReduceScatterJob:
    """One quantized reduce-scatter, in three steps that run on one thread: ``pack`` (each
    peer's chunk quantized, headers written), the exchange (one all-to-all), ``land``
    (headers checked, pieces summed into the output in rank order, payloads given back)."""

    def __init__(
        self,
        grad: torch.Tensor,
        out: torch.Tensor,
        group: dist.ProcessGroup,
        spec: BlockQuantization,
        buffers: QuantizationBuffers,
        *,
        average: bool,
        report: ErrorReport | None,
        exact: ExactPositions | None,
    ) -> None:
        self.group, self.spec, self.buffers, self.average = group, spec, buffers, average
        self.report, self.exact = report, exact
        self.rank, self.size = dist.get_rank(group), dist.get_world_size(group)
        self.grad, self.out, n = grad, out, out.numel()
        self.own = grad[self.rank * n : (self.rank + 1) * n]
        self.exact_at = spec.payload_bytes(n)  # where each row's exact values start
        self.payload_bytes = self.exact_at + (exact.row_bytes if exact is not None else 0)
        self.send: torch.Tensor | None = None
        self.recv: torch.Tensor | None = None

    def pack(self) -> tuple[torch.Tensor, torch.Tensor]:
        n, spec, buffers = self.out.numel(), self.spec, self.buffers
        send = self.send = buffers.payloads(self.size, self.payload_bytes)
        finite = is_finite(self.own)  # summed exactly: to itself a rank sends the header only
        sums = ErrorSums() if self.report is not None else None
        for dst in range(self.size):
            if dst != self.rank and finite:
                chunk, payload = self.grad[dst * n : (dst + 1) * n], send[dst, HEADER_BYTES:]
                finite = quantize_blocks(chunk, spec, payload, buffers.scratch(n), sums)
                if self.exact is not None:
                    self.exact.write(chunk, dst, send[dst, self.exact_at :])
        write_headers(send, self.grad, finite)
        if self.report is not None and sums is not None and finite:
            self.report(sums, n * (self.size - 1))
        self.recv = buffers.payloads(self.size, self.payload_bytes)
        return send, self.recv

    def run(self, group: dist.ProcessGroup) -> None:
        """All three steps, the exchange over ``group`` (a worker's clone), blocking."""
        send, recv = self.pack()
        dist.all_to_all_single(recv, send, group=group)
        self.land()

    def land(self) -> None:
        assert self.send is not None and self.recv is not None, "land() before pack()"
        try:
            total_numel = self.out.numel() * self.size
            _raise_if_any_non_finite(self.recv, "reduce_scatter", self.group, total_numel)
            self._sum_into_out(self.recv)
        finally:
            self.buffers.give_back(self.send)
            self.buffers.give_back(self.recv)
            self.send = self.recv = None

    def _sum_into_out(self, recv: torch.Tensor) -> None:
        """The pieces in rank order (the same sum every run), straight into the output when
        it is fp32 and apart from this rank's own chunk, else through one temporary."""
        out, own, n = self.out, self.own, self.out.numel()
        direct = out.dtype == torch.float32 and not overlaps(out, own)
        total = out if direct else torch.empty(n, dtype=torch.float32)
        for src in range(self.size):
            payload = recv[src, HEADER_BYTES:]
            if src == self.rank and src == 0:
                total.copy_(own)
            elif src == self.rank:
                total.add_(own)
            elif src == 0:  # the first piece is written, not added: no zero-fill pass
                dequantize_blocks(payload, self.spec, n, total)
            else:
                accumulate_blocks(payload, self.spec, n, total, self.buffers.scratch(n))
        if self.average:
            total.div_(self.size)
        if self.exact is not None:
            self._overwrite_exact(recv, total)
        if not direct:
            out.copy_(total)

    def _overwrite_exact(self, recv: torch.Tensor, total: torch.Tensor) -> None:
        """This chunk's exact positions: the fp32 values summed in rank order."""
        assert self.exact is not None
        exact, rank = self.exact, self.rank
        values = torch.zeros(len(exact.per_rank[rank]), dtype=torch.float32)
        for src in range(self.size):
            if src == rank:
                values.add_(self.own[exact.per_rank[rank]])
            else:
                values.add_(exact.read(recv[src, self.exact_at :], rank))
        if self.average:
            values.div_(self.size)
        exact.overwrite(total, rank, values)


class QuantizedReduction:
    """The ``Work`` of an async quantized reduce-scatter run on the calling thread: the
    all-to-all is in flight; ``wait()`` lands it (headers checked, pieces summed). Until
    then the input and the output must stay untouched. An error (``NonFiniteError``) is
    raised by ``wait()`` only, never by a poll of ``is_completed()``: polls land at
    different moments on different ranks, and a rank that raised early would leave its
    peers waiting in its next collective."""

    def __init__(self, job: _ReduceScatterJob, work: Work | None) -> None:
        self._job, self._work = job, work
        self._done = False
        self._error: Exception | None = None

    def is_completed(self) -> bool:
        if not self._done and (self._work is None or self._work.is_completed()):
            with contextlib.suppress(Exception):  # kept for wait(), where every rank raises it
                self.wait()
        return self._done and self._error is None

    def wait(self) -> bool:
        if self._error is not None:
            raise self._error
        if self._done:
            return True
        if self._work is not None:
            self._work.wait()
        self._done = True
        try:
            self._job.land()
        except Exception as error:
            self._error = error
            raise
        return True


def quantized_reduce_scatter_into(
    unsharded: torch.Tensor,
    out_shard: torch.Tensor,
    group: dist.ProcessGroup,
    spec: BlockQuantization,
    *,
    average: bool = True,
    async_op: bool = False,
    buffers: QuantizationBuffers | None = None,
    worker: CollectiveWorker | None = None,
    report: ErrorReport | None = None,
    exact: ExactPositions | None = None,
) -> Work | None:
    """``out_shard = mean (or sum) over ranks of unsharded[rank chunk]``, each peer's chunk
    carried block-quantized. ``async_op``: return a ``Work``; until it is waited on, the
    input and the output stay untouched. ``buffers``: where payloads and scratch come from
    (fresh tensors without). ``worker``: run the whole call on that ``CollectiveWorker``'s
    thread. ``report``: told the relative error of what this rank quantized and its count.
    ``exact``: positions of ``unsharded`` carried in fp32 beside the codes."""
    unsharded, out_shard = check_flat(unsharded, "unsharded"), check_flat(out_shard, "out_shard")
    check_codable(unsharded, "unsharded")
    check_codable(out_shard, "out_shard")
    group, _, size = membership(group, "group")
    check_shard_sizes(unsharded.numel(), "unsharded", out_shard, "out_shard", size)
    _check_exact(exact, unsharded.numel(), size)
    buffers = buffers if buffers is not None else QuantizationBuffers(keep=0)
    grad = unsharded.detach().float()
    job = _ReduceScatterJob(
        grad, out_shard, group, spec, buffers, average=average, report=report, exact=exact
    )
    wire_bytes = size * job.payload_bytes
    record_comm("quantized_reduce_scatter", group_name(group), wire_bytes, torch.uint8)
    work: Work
    if worker is not None:
        clone = worker.clone(group)
        work = worker.submit(lambda: job.run(clone))
    else:
        send, recv = job.pack()
        exchange = dist.all_to_all_single(recv, send, group=group, async_op=True)
        work = QuantizedReduction(job, cast("Work | None", exchange))
    return _returned(work, async_op)


def quantized_all_gather_into(
    shard: torch.Tensor,
    unsharded: torch.Tensor,
    group: dist.ProcessGroup,
    spec: BlockQuantization,
    *,
    async_op: bool = False,
    buffers: QuantizationBuffers | None = None,
    worker: CollectiveWorker | None = None,
    report: ErrorReport | None = None,
    exact: ExactPositions | None = None,
) -> Work | None:
    """``unsharded`` = every rank's ``shard``, carried block-quantized; every slot, this
    rank's included, holds the dequantized values, so all ranks hold the same weights.
    Non-finite shards raise ``NonFiniteError`` on every rank. ``buffers``, ``worker``,
    ``report``, ``exact``: as for the reduce-scatter; without a worker the gather is
    blocking (``async_op`` or not)."""
    shard, unsharded = check_flat(shard, "shard"), check_flat(unsharded, "unsharded")
    check_codable(shard, "shard")
    check_codable(unsharded, "unsharded")
    group, _, size = membership(group, "group")
    check_shard_sizes(unsharded.numel(), "unsharded", shard, "shard", size)
    _check_exact(exact, unsharded.numel(), size)
    kept = buffers if buffers is not None else QuantizationBuffers(keep=0)
    payload_bytes = spec.payload_bytes(shard.numel()) + (exact.row_bytes if exact else 0)
    record_comm("quantized_all_gather", group_name(group), payload_bytes, torch.uint8)
    extras = (report, exact)
    if worker is None:
        _gather(shard, unsharded, (group, group), spec, kept, extras)
        return None
    clone = worker.clone(group)
    job = functools.partial(_gather, shard, unsharded, (group, clone), spec, kept, extras)
    return _returned(worker.submit(job), async_op)


def _check_exact(exact: ExactPositions | None, numel: int, size: int) -> None:
    if exact is not None and (exact.numel, exact.size) != (numel, size):
        raise ValueError(
            f"exact positions were made for {exact.numel} values over {exact.size} ranks, "
            f"not {numel} over {size}: build ExactPositions for this buffer and group"
        )


def _returned(work: Work, async_op: bool) -> Work | None:
    """``work`` for an async call; else waited on here."""
    if async_op:
        return work
    work.wait()
    return None


def _gather(
    shard: torch.Tensor,
    unsharded: torch.Tensor,
    groups: tuple[dist.ProcessGroup, dist.ProcessGroup],
    spec: BlockQuantization,
    buffers: QuantizationBuffers,
    extras: tuple[ErrorReport | None, ExactPositions | None],
) -> None:
    """Quantize ``shard``, gather every rank's payload over ``groups[1]`` (the exchange's),
    dequantize every slot (errors name ``groups[0]``, the caller's)."""
    (group, exchange_group), (report, exact) = groups, extras
    n, size, rank = shard.numel(), dist.get_world_size(group), dist.get_rank(group)
    values = shard.detach().float()
    exact_at = spec.payload_bytes(n)
    mine = buffers.payloads(1, exact_at + (exact.row_bytes if exact is not None else 0))
    sums = ErrorSums() if report is not None else None
    finite = quantize_blocks(values, spec, mine[0, HEADER_BYTES:], buffers.scratch(n), sums)
    if exact is not None:
        exact.write(values, rank, mine[0, exact_at:])
    write_headers(mine, values, finite)
    if report is not None and sums is not None and finite:
        report(sums, n)
    gathered = buffers.payloads(size, mine.shape[1])
    try:
        all_gather_single(gathered.view(-1), mine.view(-1), exchange_group, async_op=False)
        _raise_if_any_non_finite(gathered, "all_gather", group, n)
        in_place = unsharded.dtype == torch.float32
        for src in range(size):  # its own slot too: every rank computes with the same weights
            slot = unsharded[src * n : (src + 1) * n]
            target = slot if in_place else buffers.scratch(n)
            dequantize_blocks(gathered[src, HEADER_BYTES:], spec, n, target)
            if exact is not None:
                exact.overwrite(target, src, exact.read(gathered[src, exact_at:], src))
            if not in_place:
                slot.copy_(target)
    finally:
        buffers.give_back(mine)
        buffers.give_back(gathered)
