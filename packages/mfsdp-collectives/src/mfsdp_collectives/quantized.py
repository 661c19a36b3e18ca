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

import math
from dataclasses import dataclass
from typing import cast

import torch
import torch.distributed as dist

from ._checks import check_flat
from ._compat import Work, all_gather_single, reduce_scatter_single
from ._op_args import check_shard_sizes, membership
from .custom_comms import EmptyBuffers
from .naming import group_name
from .tracer import record_comm

__all__ = [
    "BlockQuantization",
    "NonFiniteError",
    "QuantizedAllGather",
    "QuantizedReduceScatter",
    "QuantizedReduction",
    "dequantize_blocks",
    "quantize_blocks",
    "quantized_all_gather_into",
    "quantized_reduce_scatter_into",
]

_HEADER = 4


@dataclass(frozen=True)
class BlockQuantization:
    """``bits`` (8 or 4) per value, one fp32 scale per ``block`` values (symmetric, round to
    nearest: a value is off by at most half its block's scale, ``amax / (2 * qmax)``)."""

    bits: int = 8
    block: int = 2048

    def __post_init__(self) -> None:
        if self.bits not in (4, 8):
            raise ValueError(f"bits={self.bits!r} must be 8 or 4")
        if isinstance(self.block, bool) or not isinstance(self.block, int) or self.block < 2:
            raise ValueError(f"block={self.block!r} must be an int >= 2 (2048 is the default)")

    @property
    def qmax(self) -> int:
        return 127 if self.bits == 8 else 7

    def code_bytes(self, numel: int) -> int:
        """Bytes of the codes of ``numel`` values, padded so the scales stay aligned."""
        raw = numel if self.bits == 8 else (numel + 1) // 2
        return (raw + 3) // 4 * 4

    def payload_bytes(self, numel: int) -> int:
        """Bytes that carry ``numel`` values: header, codes, scales."""
        return _HEADER + self.code_bytes(numel) + 4 * math.ceil(numel / self.block)


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


def _first_non_finite(x: torch.Tensor) -> int:
    bad = ~torch.isfinite(x)
    if not bool(bad.any()):
        return -1
    return int(bad.nonzero()[0, 0])


def _block_codes(x: torch.Tensor, spec: BlockQuantization) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` (a whole number of blocks) as float codes and one scale per block."""
    by_block = x.view(-1, spec.block)
    amax = torch.linalg.vector_norm(by_block, ord=math.inf, dim=1)  # one pass: max |x|
    scales = torch.where(amax > 0, amax / spec.qmax, torch.ones_like(amax))
    codes = torch.div(by_block, scales[:, None]).round_().clamp_(-spec.qmax, spec.qmax)
    return codes.view(-1), scales


def quantize_blocks(x: torch.Tensor, spec: BlockQuantization, out: torch.Tensor) -> None:
    """Write ``x``'s codes and scales (finite ``x``, 1-D) into ``out`` (uint8, past the
    header: ``spec.payload_bytes(x.numel()) - 4`` bytes)."""
    n = x.numel()
    whole = n // spec.block * spec.block
    parts = [_block_codes(x[:whole], spec)] if whole else []
    if whole < n:  # the ragged last block, padded with zeros (they code as 0)
        tail = torch.zeros(spec.block, dtype=torch.float32)
        tail[: n - whole] = x[whole:]
        codes, scales = _block_codes(tail, spec)
        parts.append((codes[: n - whole], scales))
    codes = parts[0][0] if len(parts) == 1 else torch.cat([c for c, _ in parts])
    scales = parts[0][1] if len(parts) == 1 else torch.cat([s for _, s in parts])
    code_bytes = spec.code_bytes(n)
    if spec.bits == 8:
        out[:n].copy_(codes.to(torch.int8).view(torch.uint8))
    else:
        nibbles = (codes + 8).to(torch.uint8)
        if n % 2:
            nibbles = torch.cat([nibbles, torch.full((1,), 8, dtype=torch.uint8)])
        pairs = nibbles.view(-1, 2)
        out[: pairs.shape[0]].copy_(pairs[:, 0] | (pairs[:, 1] << 4))
    out[code_bytes : code_bytes + 4 * scales.numel()].copy_(scales.view(torch.uint8))


def dequantize_blocks(
    payload: torch.Tensor, spec: BlockQuantization, numel: int, out: torch.Tensor
) -> None:
    """``out`` (fp32, ``numel``) = the values ``quantize_blocks`` wrote into ``payload``."""
    code_bytes = spec.code_bytes(numel)
    blocks = math.ceil(numel / spec.block)
    scales = payload[code_bytes : code_bytes + 4 * blocks].clone().view(torch.float32)
    if spec.bits == 8:
        codes = payload[:numel].view(torch.int8).to(torch.float32)
    else:
        packed = payload[: (numel + 1) // 2]
        pairs = torch.stack([packed & 0x0F, packed >> 4], dim=1).flatten()[:numel]
        codes = pairs.to(torch.float32) - 8
    per_value = scales.repeat_interleave(spec.block)[:numel]
    torch.mul(codes, per_value, out=out)


def _pack(x: torch.Tensor, spec: BlockQuantization, first_bad: int, out: torch.Tensor) -> None:
    out[:_HEADER].copy_(torch.tensor([first_bad], dtype=torch.int32).view(torch.uint8))
    if first_bad < 0 and x.numel():
        quantize_blocks(x, spec, out[_HEADER:])


def _raise_if_any_non_finite(
    payloads: torch.Tensor, op: str, group: dist.ProcessGroup, numel: int
) -> None:
    """Every rank holds every sender's header: all raise alike, after the collective."""
    firsts = payloads[:, :_HEADER].clone().view(torch.int32).flatten().tolist()
    for rank, first in enumerate(firsts):
        if first >= 0:
            raise NonFiniteError(op, group_name(group), rank, first, numel)


class QuantizedReduction:
    """The ``Work`` of an async quantized reduce-scatter: the all-to-all is in flight;
    ``wait()`` lands it, checks every sender's header and sums the pieces into the output
    (fp32, rank order). Until then the input and the output must stay untouched."""

    def __init__(
        self,
        work: Work | None,
        recv: torch.Tensor,
        own: torch.Tensor,
        out: torch.Tensor,
        spec: BlockQuantization,
        group: dist.ProcessGroup,
        *,
        average: bool,
    ) -> None:
        self._work, self._recv, self._own, self._out = work, recv, own, out
        self._spec, self._group, self._average = spec, group, average
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
        group, n, size = self._group, self._out.numel(), self._recv.shape[0]
        _raise_if_any_non_finite(self._recv, "reduce_scatter", group, n * size)
        rank = dist.get_rank(group)
        total, piece = torch.zeros(n, dtype=torch.float32), torch.empty(n, dtype=torch.float32)
        for src in range(size):  # rank order: the same sum on every run
            if src == rank:
                total.add_(self._own)
                continue
            dequantize_blocks(self._recv[src, _HEADER:], self._spec, n, piece)
            total.add_(piece)
        if self._average:
            total.div_(size)
        self._out.copy_(total)
        return True


def quantized_reduce_scatter_into(
    unsharded: torch.Tensor,
    out_shard: torch.Tensor,
    group: dist.ProcessGroup,
    spec: BlockQuantization,
    *,
    average: bool = True,
    async_op: bool = False,
) -> QuantizedReduction | None:
    """``out_shard = mean (or sum) over ranks of unsharded[rank chunk]``, each peer's chunk
    carried block-quantized. Any chunk size; fp32 sums; non-finite inputs raise
    ``NonFiniteError`` on every rank. ``async_op``: return the ``QuantizedReduction`` with
    the all-to-all in flight (quantizing is done; summing waits for ``wait()``)."""
    unsharded, out_shard = check_flat(unsharded, "unsharded"), check_flat(out_shard, "out_shard")
    group, rank, size = membership(group, "group")
    check_shard_sizes(unsharded.numel(), "unsharded", out_shard, "out_shard", size)
    n = out_shard.numel()
    grad = unsharded.detach().float()
    first_bad = _first_non_finite(grad)
    send = torch.zeros(size, spec.payload_bytes(n), dtype=torch.uint8)
    for dst in range(size):
        # its own chunk is summed exactly: to itself it sends the header only
        chunk = grad[dst * n : (dst + 1) * n] if dst != rank else grad[:0]
        _pack(chunk, spec, first_bad, send[dst])
    record_comm("quantized_reduce_scatter", group_name(group), send.numel(), torch.uint8)
    recv = torch.empty_like(send)
    work = cast("Work | None", dist.all_to_all_single(recv, send, group=group, async_op=True))
    own = grad[rank * n : (rank + 1) * n]
    reduction = QuantizedReduction(work, recv, own, out_shard, spec, group, average=average)
    if async_op:
        return reduction
    reduction.wait()
    return None


def quantized_all_gather_into(
    shard: torch.Tensor, unsharded: torch.Tensor, group: dist.ProcessGroup, spec: BlockQuantization
) -> None:
    """``unsharded`` = every rank's ``shard``, carried block-quantized (blocking); every slot,
    this rank's included, holds the dequantized values, so all ranks hold the same weights.
    Non-finite shards raise ``NonFiniteError`` on every rank."""
    shard, unsharded = check_flat(shard, "shard"), check_flat(unsharded, "unsharded")
    group, _, size = membership(group, "group")
    check_shard_sizes(unsharded.numel(), "unsharded", shard, "shard", size)
    n = shard.numel()
    values = shard.detach().float()
    mine = torch.zeros(spec.payload_bytes(n), dtype=torch.uint8)
    _pack(values, spec, _first_non_finite(values), mine)
    record_comm("quantized_all_gather", group_name(group), mine.numel(), torch.uint8)
    gathered = torch.empty(size, mine.numel(), dtype=torch.uint8)
    all_gather_single(gathered.view(-1), mine, group, async_op=False)
    _raise_if_any_non_finite(gathered, "all_gather", group, n)
    piece = torch.empty(n, dtype=torch.float32)
    for src in range(size):  # its own slot too: every rank must compute with the same weights
        dequantize_blocks(gathered[src, _HEADER:], spec, n, piece)
        unsharded[src * n : (src + 1) * n].copy_(piece)


class _QuantizedComm(EmptyBuffers):
    """FSDP2's comm protocol over the quantized collectives; ``min_numel``: a chunk smaller
    than this (a tiny unit: norms, biases) travels in full precision, where the scales'
    bytes and the error would buy nothing."""

    def __init__(
        self, spec: BlockQuantization | None = None, *, min_numel: int | None = None
    ) -> None:
        self.spec = spec if spec is not None else BlockQuantization()
        self.min_numel = self.spec.block if min_numel is None else min_numel


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
            input_tensor, output_tensor, group, self.spec, average=average, async_op=async_op
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
        quantized_all_gather_into(input_tensor, output_tensor, group, self.spec)
        return None
