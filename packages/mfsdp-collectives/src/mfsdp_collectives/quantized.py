"""Block-quantized all-gather and reduce-scatter (ZeRO++'s qwZ and qgZ, done so that none of
DeepSpeed's reported failures can happen).

Values travel as int8 (or int4, two to a byte) with one fp32 scale per block of ``block``
elements (2048 by default), about 0.25x (0.13x) of fp32's bytes. How it avoids what went
wrong elsewhere:

- **Any size.** Blocks start at each rank's chunk and the last one is ragged: no size must be
  a multiple of 8, of the block, or of the group (deepspeedai/DeepSpeed#4852, #4386).
- **One hop, summed in fp32.** The reduce-scatter is one all-to-all of quantized chunks: each
  rank's contribution is quantized once, and the receiver dequantizes every piece and adds
  them in fp32 in rank order (its own chunk exactly), so nothing is requantized on the way
  and every run gives the same bits.
- **Non-finite inputs are reported, on every rank.** Each payload carries the first
  non-finite index of its sender's whole input, so all ranks learn the same thing from the
  same collective and raise the same ``NonFiniteError`` (sender rank and element); nothing is
  quantized from an inf scale (#6926's silent infs) and no rank is left waiting.

The payload of one destination: a header (int32: the sender's first non-finite index, -1
for none), the codes (padded to 4 bytes), then the block scales (fp32).
"""

from __future__ import annotations

from typing import cast

import torch
import torch.distributed as dist

from ._checks import check_flat
from ._compat import Work, all_gather_single, reduce_scatter_single
from ._op_args import check_shard_sizes, membership
from .block_codec import (
    HEADER_BYTES,
    BlockQuantization,
    accumulate_blocks,
    dequantize_blocks,
    is_finite,
    quantize_blocks,
    write_headers,
)
from .custom_comms import EmptyBuffers
from .naming import group_name
from .quantization_buffers import QuantizationBuffers
from .tracer import record_comm

__all__ = [
    "NonFiniteError",
    "QuantizedAllGather",
    "QuantizedReduceScatter",
    "QuantizedReduction",
    "quantized_all_gather_into",
    "quantized_reduce_scatter_into",
]


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
    firsts = payloads[:, :HEADER_BYTES].clone().view(torch.int32).flatten().tolist()
    for rank, first in enumerate(firsts):
        if first >= 0:
            raise NonFiniteError(op, group_name(group), rank, first, numel)


class QuantizedReduction:
    """The ``Work`` of an async quantized reduce-scatter: the all-to-all is in flight;
    ``wait()`` lands it, checks every sender's header and sums the pieces into the output
    (fp32, rank order), then gives the payloads back. Until then the input and the output
    must stay untouched."""

    def __init__(
        self,
        work: Work | None,
        payloads: tuple[torch.Tensor, torch.Tensor],
        own: torch.Tensor,
        out: torch.Tensor,
        spec: BlockQuantization,
        group: dist.ProcessGroup,
        *,
        average: bool,
        buffers: QuantizationBuffers,
    ) -> None:
        self._work, self._payloads, self._own, self._out = work, payloads, own, out
        self._spec, self._group, self._average = spec, group, average
        self._buffers = buffers
        self._done = False

    def is_completed(self) -> bool:
        if not self._done and (self._work is None or self._work.is_completed()):
            self.wait()
        return self._done

    def wait(self) -> bool:
        if self._done:
            return True
        if self._work is not None:
            self._work.wait()
        self._done = True
        send, recv = self._payloads
        try:
            n, size = self._out.numel(), recv.shape[0]
            _raise_if_any_non_finite(recv, "reduce_scatter", self._group, n * size)
            self._sum_into_out(recv)
        finally:
            self._buffers.give_back(send)
            self._buffers.give_back(recv)
        return True

    def _sum_into_out(self, recv: torch.Tensor) -> None:
        """The pieces in rank order (the same sum every run), straight into the output when
        it is fp32 and apart from this rank's own chunk, else through one temporary."""
        out, own, n = self._out, self._own, self._out.numel()
        direct = out.dtype == torch.float32 and not _overlap(out, own)
        total = out if direct else torch.empty(n, dtype=torch.float32)
        rank = dist.get_rank(self._group)
        for src in range(recv.shape[0]):
            payload = recv[src, HEADER_BYTES:]
            if src == rank and src == 0:
                total.copy_(own)
            elif src == rank:
                total.add_(own)
            elif src == 0:  # the first piece is written, not added: no zero-fill pass
                dequantize_blocks(payload, self._spec, n, total)
            else:
                accumulate_blocks(payload, self._spec, n, total, self._buffers.scratch(n))
        if self._average:
            total.div_(recv.shape[0])
        if not direct:
            out.copy_(total)


def _overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.untyped_storage().data_ptr() != b.untyped_storage().data_ptr():
        return False
    a_lo, b_lo = a.data_ptr(), b.data_ptr()
    return a_lo < b_lo + b.numel() * b.element_size() and b_lo < a_lo + a.numel() * a.element_size()


def quantized_reduce_scatter_into(
    unsharded: torch.Tensor,
    out_shard: torch.Tensor,
    group: dist.ProcessGroup,
    spec: BlockQuantization,
    *,
    average: bool = True,
    async_op: bool = False,
    buffers: QuantizationBuffers | None = None,
) -> QuantizedReduction | None:
    """``out_shard = mean (or sum) over ranks of unsharded[rank chunk]``, each peer's chunk
    carried block-quantized. Any chunk size; fp32 sums; non-finite inputs raise
    ``NonFiniteError`` on every rank. ``async_op``: return the ``QuantizedReduction`` with
    the all-to-all in flight (quantizing is done; summing waits for ``wait()``).
    ``buffers``: where the payloads and scratch come from (reused across calls); without
    it, fresh tensors every call."""
    unsharded, out_shard = check_flat(unsharded, "unsharded"), check_flat(out_shard, "out_shard")
    group, rank, size = membership(group, "group")
    check_shard_sizes(unsharded.numel(), "unsharded", out_shard, "out_shard", size)
    buffers = buffers if buffers is not None else QuantizationBuffers(keep=0)
    n = out_shard.numel()
    grad = unsharded.detach().float()
    send = buffers.payloads(size, spec.payload_bytes(n))
    own = grad[rank * n : (rank + 1) * n]
    finite = is_finite(own)  # summed exactly: to itself a rank sends the header only
    for dst in range(size):
        if dst != rank and finite:
            chunk, payload = grad[dst * n : (dst + 1) * n], send[dst, HEADER_BYTES:]
            finite = quantize_blocks(chunk, spec, payload, buffers.scratch(n))
    write_headers(send, grad, finite)
    record_comm("quantized_reduce_scatter", group_name(group), send.numel(), torch.uint8)
    recv = buffers.payloads(size, send.shape[1])
    work = cast("Work | None", dist.all_to_all_single(recv, send, group=group, async_op=True))
    reduction = QuantizedReduction(
        work, (send, recv), own, out_shard, spec, group, average=average, buffers=buffers
    )
    if async_op:
        return reduction
    reduction.wait()
    return None


def quantized_all_gather_into(
    shard: torch.Tensor,
    unsharded: torch.Tensor,
    group: dist.ProcessGroup,
    spec: BlockQuantization,
    *,
    buffers: QuantizationBuffers | None = None,
) -> None:
    """``unsharded`` = every rank's ``shard``, carried block-quantized (blocking); every slot,
    this rank's included, holds the dequantized values, so all ranks hold the same weights.
    Non-finite shards raise ``NonFiniteError`` on every rank. ``buffers``: as for the
    reduce-scatter."""
    shard, unsharded = check_flat(shard, "shard"), check_flat(unsharded, "unsharded")
    group, _, size = membership(group, "group")
    check_shard_sizes(unsharded.numel(), "unsharded", shard, "shard", size)
    buffers = buffers if buffers is not None else QuantizationBuffers(keep=0)
    n = shard.numel()
    values = shard.detach().float()
    mine = buffers.payloads(1, spec.payload_bytes(n))
    finite = quantize_blocks(values, spec, mine[0, HEADER_BYTES:], buffers.scratch(n))
    write_headers(mine, values, finite)
    record_comm("quantized_all_gather", group_name(group), mine.numel(), torch.uint8)
    gathered = buffers.payloads(size, mine.shape[1])
    try:
        all_gather_single(gathered.view(-1), mine.view(-1), group, async_op=False)
        _raise_if_any_non_finite(gathered, "all_gather", group, n)
        in_place = unsharded.dtype == torch.float32
        for src in range(size):  # its own slot too: every rank computes with the same weights
            slot = unsharded[src * n : (src + 1) * n]
            target = slot if in_place else buffers.scratch(n)
            dequantize_blocks(gathered[src, HEADER_BYTES:], spec, n, target)
            if not in_place:
                slot.copy_(target)
    finally:
        buffers.give_back(mine)
        buffers.give_back(gathered)


class _QuantizedComm(EmptyBuffers):
    """FSDP2's comm protocol over the quantized collectives; ``min_numel``: a chunk smaller
    than this (a tiny unit: norms, biases) travels in full precision, where the scales'
    bytes and the error would buy nothing. One comm may serve many units: its
    ``QuantizationBuffers`` are then shared, which bounds their memory."""

    def __init__(
        self,
        spec: BlockQuantization | None = None,
        *,
        min_numel: int | None = None,
        buffers: QuantizationBuffers | None = None,
    ) -> None:
        self.spec = spec if spec is not None else BlockQuantization()
        self.min_numel = self.spec.block if min_numel is None else min_numel
        self.buffers = buffers if buffers is not None else QuantizationBuffers()


class QuantizedReduceScatter(_QuantizedComm):
    """A reduce-scatter comm (``FSDPModule.set_custom_reduce_scatter``) that carries the
    gradients block-quantized: ``quantized_reduce_scatter_into``."""

    def __call__(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: dist.ProcessGroup,
        op: dist.ReduceOp.RedOpType,
        async_op: bool = False,
    ) -> Work | None:
        if op not in (dist.ReduceOp.SUM, dist.ReduceOp.AVG):
            raise ValueError(f"a quantized reduce-scatter sums or averages, not {op}")
        if output_tensor.numel() < self.min_numel:
            return reduce_scatter_single(output_tensor, input_tensor, op, group, async_op)
        average = op == dist.ReduceOp.AVG
        return quantized_reduce_scatter_into(
            input_tensor,
            output_tensor,
            group,
            self.spec,
            average=average,
            async_op=async_op,
            buffers=self.buffers,
        )


class QuantizedAllGather(_QuantizedComm):
    """An all-gather comm (``FSDPModule.set_custom_all_gather``) that carries the weights
    block-quantized: ``quantized_all_gather_into``."""

    def __call__(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: dist.ProcessGroup,
        async_op: bool = False,
    ) -> Work | None:
        if input_tensor.numel() < self.min_numel:
            return all_gather_single(output_tensor, input_tensor, group, async_op)
        quantized_all_gather_into(
            input_tensor, output_tensor, group, self.spec, buffers=self.buffers
        )
        return None
