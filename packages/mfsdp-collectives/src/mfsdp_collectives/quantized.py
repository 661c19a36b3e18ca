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

import torch
import torch.distributed as dist

from ._checks import check_flat
from ._compat import all_gather_single
from ._op_args import check_shard_sizes, membership
from .naming import group_name
from .tracer import record_comm

__all__ = [
    "BlockQuantization",
    "NonFiniteError",
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


def quantize_blocks(x: torch.Tensor, spec: BlockQuantization, out: torch.Tensor) -> None:
    """Write ``x``'s codes and scales (finite ``x``, 1-D) into ``out`` (uint8, past the
    header: ``spec.payload_bytes(x.numel()) - 4`` bytes)."""
    n = x.numel()
    blocks = math.ceil(n / spec.block)
    padded = torch.zeros(blocks * spec.block, dtype=torch.float32)
    padded[:n] = x
    by_block = padded.view(blocks, spec.block)
    amax = by_block.abs().amax(dim=1)
    scales = torch.where(amax > 0, amax / spec.qmax, torch.ones_like(amax))
    codes = torch.round(by_block / scales[:, None]).clamp_(-spec.qmax, spec.qmax).flatten()[:n]
    code_bytes = spec.code_bytes(n)
    if spec.bits == 8:
        out[:n].copy_(codes.to(torch.int8).view(torch.uint8))
    else:
        nibbles = (codes + 8).to(torch.uint8)
        if n % 2:
            nibbles = torch.cat([nibbles, torch.full((1,), 8, dtype=torch.uint8)])
        pairs = nibbles.view(-1, 2)
        out[: pairs.shape[0]].copy_(pairs[:, 0] | (pairs[:, 1] << 4))
    out[code_bytes : code_bytes + 4 * blocks].copy_(scales.view(torch.uint8))


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
    if first_bad < 0:
        quantize_blocks(x, spec, out[_HEADER:])


def _raise_if_any_non_finite(
    payloads: torch.Tensor, op: str, group: dist.ProcessGroup, numel: int
) -> None:
    """Every rank holds every sender's header: all raise alike, after the collective."""
    firsts = payloads[:, :_HEADER].clone().view(torch.int32).flatten().tolist()
    for rank, first in enumerate(firsts):
        if first >= 0:
            raise NonFiniteError(op, group_name(group), rank, first, numel)


def quantized_reduce_scatter_into(
    unsharded: torch.Tensor,
    out_shard: torch.Tensor,
    group: dist.ProcessGroup,
    spec: BlockQuantization,
    *,
    average: bool = True,
) -> None:
    """``out_shard = mean (or sum) over ranks of unsharded[rank chunk]``, each peer's chunk
    carried block-quantized (blocking). Any chunk size; fp32 sums; non-finite inputs raise
    ``NonFiniteError`` on every rank."""
    unsharded, out_shard = check_flat(unsharded, "unsharded"), check_flat(out_shard, "out_shard")
    group, rank, size = membership(group, "group")
    check_shard_sizes(unsharded.numel(), "unsharded", out_shard, "out_shard", size)
    n = out_shard.numel()
    grad = unsharded.detach().float()
    first_bad = _first_non_finite(grad)
    width = spec.payload_bytes(n)
    send = torch.zeros(size, width, dtype=torch.uint8)
    for dst in range(size):
        _pack(grad[dst * n : (dst + 1) * n], spec, first_bad, send[dst])
    record_comm("reduce_scatter", group_name(group), send.numel(), torch.uint8)
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)
    _raise_if_any_non_finite(recv, "reduce_scatter", group, unsharded.numel())
    total, piece = torch.zeros(n, dtype=torch.float32), torch.empty(n, dtype=torch.float32)
    for src in range(size):  # rank order: the same sum on every run
        if src == rank:
            total.add_(grad[rank * n : (rank + 1) * n])
            continue
        dequantize_blocks(recv[src, _HEADER:], spec, n, piece)
        total.add_(piece)
    if average:
        total.div_(size)
    out_shard.copy_(total)


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
    record_comm("all_gather", group_name(group), mine.numel(), torch.uint8)
    gathered = torch.empty(size, mine.numel(), dtype=torch.uint8)
    all_gather_single(gathered.view(-1), mine, group, async_op=False)
    _raise_if_any_non_finite(gathered, "all_gather", group, n)
    piece = torch.empty(n, dtype=torch.float32)
    for src in range(size):  # its own slot too: every rank must compute with the same weights
        dequantize_blocks(gathered[src, _HEADER:], spec, n, piece)
        unsharded[src * n : (src + 1) * n].copy_(piece)
