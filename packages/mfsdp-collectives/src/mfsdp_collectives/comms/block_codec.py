"""Block quantization of flat fp32 values: what the quantized collectives put on the wire.

Each run of ``block`` values codes as int8 (or int4, two to a byte) with one fp32 scale,
symmetric, round to nearest; the last block is ragged, so any length works. Every pass
streams memory, so the code counts them (quantizing: three reads, one byte written per value;
summing a payload in: one conversion, one multiply-add). Scratch comes from the caller
(``QuantizationBuffers``): a fresh large tensor costs a page fault and a zeroing per page.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..core.fake import is_fake
from .quantization_errors import ErrorSums

__all__ = [
    "HEADER_BYTES",
    "CODED_DTYPES",
    "BlockQuantization",
    "accumulate_blocks",
    "check_codable",
    "dequantize_blocks",
    "first_non_finite",
    "is_finite",
    "quantize_blocks",
    "write_headers",
]

HEADER_BYTES = 4
CODED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
"""What the codec codes: floating values. Bytes (float8 weights travel as uint8) and
integers mean nothing as numbers; rounding one would change them into other values."""


def check_codable(t: torch.Tensor, arg: str) -> None:
    """Raise unless ``t`` holds values the codec can code (``CODED_DTYPES``)."""
    if t.dtype not in CODED_DTYPES:
        raise TypeError(
            f"{arg} is {t.dtype}: block quantization codes float32, bfloat16 or float16 "
            "values; a tensor of another dtype (float8 weights travel as uint8 bytes) must "
            "go over a plain collective"
        )


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
        return (self._raw_code_bytes(numel) + 3) // 4 * 4

    def payload_bytes(self, numel: int) -> int:
        """Bytes that carry ``numel`` values: header, codes, scales."""
        return HEADER_BYTES + self.code_bytes(numel) + 4 * math.ceil(numel / self.block)

    def _raw_code_bytes(self, numel: int) -> int:
        return numel if self.bits == 8 else (numel + 1) // 2


def first_non_finite(x: torch.Tensor) -> int:
    """The index of ``x``'s first inf or NaN, or -1 (a slow pass: call it once one is known)."""
    bad = ~torch.isfinite(x)
    if not bool(bad.any()):
        return -1
    return int(bad.nonzero()[0, 0])


def is_finite(x: torch.Tensor) -> bool:
    """Whether ``x`` holds no inf or NaN: one min-max pass (NaN propagates through it). The
    codec's one question about values: a planning run's fake ``x`` has none, and takes the
    route of finite ones."""
    if not x.numel() or is_fake(x):
        return True
    low, high = torch.aminmax(x)
    return bool(torch.isfinite(low)) and bool(torch.isfinite(high))


def write_headers(payloads: torch.Tensor, values: torch.Tensor, finite: bool) -> None:
    """Every payload's header (a row each): the first non-finite index of the sender's whole
    input, or -1. Receivers raise on any header that is not -1, so every rank learns of an
    inf from the same collective."""
    first_bad = -1 if finite else first_non_finite(values)
    header = torch.tensor([first_bad], dtype=torch.int32).view(torch.uint8)
    payloads[:, :HEADER_BYTES].copy_(header.expand(payloads.shape[0], HEADER_BYTES))


def _blocks(x: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``x`` (1-D) as its whole blocks (a 2-D view) and its ragged tail (or ``None``)."""
    whole = x.numel() // block * block
    return x[:whole].view(-1, block), (x[whole:] if whole < x.numel() else None)


def _absmax(x: torch.Tensor, block: int) -> torch.Tensor:
    """max |x| per block (the ragged tail is a short block). Two row reductions, not
    ``abs().amax()``, an inf-norm or ``aminmax(dim=)``: those are 5-12x slower over rows on
    the CPU. NaN propagates and inf stays inf, so these few values tell whether ``x`` is
    finite."""
    rows, tail = _blocks(x, block)
    parts = [torch.maximum(rows.amax(1), rows.amin(1).neg_())] if rows.numel() else []
    if tail is not None:
        parts.append(torch.maximum(tail.amax(), tail.amin().neg()).view(1))
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def _scale_rows(x: torch.Tensor, per_block: torch.Tensor, block: int, out: torch.Tensor) -> None:
    """``out = x * per_block`` (a factor per block of ``x``), ragged tail included."""
    rows, tail = _blocks(x, block)
    o_rows, o_tail = _blocks(out, block)
    torch.mul(rows, per_block[: rows.shape[0], None], out=o_rows)
    if tail is not None and o_tail is not None:
        torch.mul(tail, per_block[-1:], out=o_tail)


def quantize_blocks(
    x: torch.Tensor,
    spec: BlockQuantization,
    out: torch.Tensor,
    scratch: torch.Tensor,
    sums: ErrorSums | None = None,
) -> bool:
    """Write ``x``'s codes and scales (fp32, 1-D) into ``out`` (uint8, past the header:
    ``spec.payload_bytes(x.numel()) - HEADER_BYTES`` bytes), using ``scratch`` (fp32, at
    least ``x.numel()``). Returns ``False``, writing nothing, if ``x`` holds inf or NaN.
    ``sums``: add the squared norms of the quantization error and of ``x`` (a pass more)."""
    n = x.numel()
    if n == 0:
        return True
    amax = _absmax(x, spec.block)
    if not is_finite(amax):  # an inf or NaN in a block makes its maximum one
        return False
    # at least the smallest normal float, so the reciprocal is finite (all-zero and
    # denormal blocks code as 0 and small codes)
    scales = (amax / spec.qmax).clamp_(min=torch.finfo(torch.float32).tiny)
    scaled = scratch[:n]
    _scale_rows(x, scales.reciprocal(), spec.block, scaled)
    # |x| * qmax / amax <= qmax up to one rounding, so rounding lands in [-qmax, qmax]
    codes = scaled.round_()
    if sums is not None:
        _measure(x, codes, scales, spec.block, sums)
    raw, code_bytes = spec._raw_code_bytes(n), spec.code_bytes(n)
    if spec.bits == 8:
        out[:n].view(torch.int8).copy_(codes)
    else:
        nibbles = torch.full((n + n % 2,), 8, dtype=torch.uint8)
        nibbles[:n].copy_(codes.add_(8))
        pairs = nibbles.view(-1, 2)
        torch.bitwise_or(pairs[:, 0], pairs[:, 1] << 4, out=out[:raw])
    out[raw:code_bytes].zero_()  # the padding: the same bytes on the wire every run
    out[code_bytes : code_bytes + 4 * scales.numel()].copy_(scales.view(torch.uint8))
    return True


def _measure(
    x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, block: int, sums: ErrorSums
) -> None:
    back = torch.empty_like(x)
    _scale_rows(codes, scales, block, back)
    error = torch.linalg.vector_norm(back.sub_(x))
    sums.add(float(error) ** 2, float(torch.linalg.vector_norm(x)) ** 2)


def _codes_and_scales(
    payload: torch.Tensor, spec: BlockQuantization, numel: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The int8 codes and the fp32 scales that ``quantize_blocks`` wrote into ``payload``."""
    code_bytes = spec.code_bytes(numel)
    blocks = math.ceil(numel / spec.block)
    scales = payload[code_bytes : code_bytes + 4 * blocks].clone().view(torch.float32)
    if spec.bits == 8:
        return payload[:numel].view(torch.int8), scales
    packed = payload[: (numel + 1) // 2]
    unpacked = torch.stack([packed & 0x0F, packed >> 4], dim=1).flatten()[:numel]
    return unpacked.to(torch.int8).sub_(8), scales


def dequantize_blocks(
    payload: torch.Tensor, spec: BlockQuantization, numel: int, out: torch.Tensor
) -> None:
    """``out`` (fp32, ``numel``) = the values ``quantize_blocks`` wrote into ``payload``."""
    codes, scales = _codes_and_scales(payload, spec, numel)
    out.copy_(codes)
    _scale_rows(out, scales, spec.block, out)


def accumulate_blocks(
    payload: torch.Tensor,
    spec: BlockQuantization,
    numel: int,
    total: torch.Tensor,
    scratch: torch.Tensor,
) -> None:
    """``total`` (fp32, ``numel``) += the values ``quantize_blocks`` wrote into ``payload``:
    the codes converted into ``scratch``, then one multiply-add per value."""
    codes, scales = _codes_and_scales(payload, spec, numel)
    as_float = scratch[:numel]
    as_float.copy_(codes)
    rows, tail = _blocks(as_float, spec.block)
    t_rows, t_tail = _blocks(total, spec.block)
    t_rows.addcmul_(rows, scales[: rows.shape[0], None])
    if tail is not None and t_tail is not None:
        t_tail.addcmul_(tail, scales[-1:])
