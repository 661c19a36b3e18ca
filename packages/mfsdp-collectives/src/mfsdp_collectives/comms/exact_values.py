"""Values a quantized collective carries in full precision beside the codes: 1-D parameters
(norms, biases), few values with an outsized effect, which ZeRO++ and its successors keep out
of quantization. The receiver overwrites what it dequantized there, so the result at those
positions is exactly a full-precision collective's. The positions are the same on every rank
(from the layout); every payload row is padded to the largest count, ``width``, so rows stay
equal-sized for one all-to-all or all-gather.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["ExactPositions"]


class ExactPositions:
    """``ranges`` (``[start, stop)`` of a flat buffer of ``numel`` values cut into ``size``
    equal chunks) as each chunk's local indices."""

    def __init__(self, ranges: Sequence[tuple[int, int]], numel: int, size: int) -> None:
        if size < 1 or numel % size:
            raise ValueError(f"numel={numel} must split into size={size} equal chunks")
        n = numel // size
        self.numel, self.size = numel, size
        self.per_rank: list[torch.Tensor] = []
        for rank in range(size):
            low, high = rank * n, (rank + 1) * n
            pieces = [
                torch.arange(max(a, low) - low, min(b, high) - low)
                for a, b in sorted(ranges)
                if max(a, low) < min(b, high)
            ]
            self.per_rank.append(torch.cat(pieces) if pieces else torch.zeros(0, dtype=torch.long))
        self.width = max(len(idx) for idx in self.per_rank)

    @property
    def row_bytes(self) -> int:
        """Bytes each payload row spends on them."""
        return 4 * self.width

    def write(self, chunk: torch.Tensor, rank: int, row: torch.Tensor) -> None:
        """Put the values of ``chunk`` (rank ``rank``'s) at its positions into ``row`` (the
        ``row_bytes`` uint8 tail of a payload row)."""
        idx = self.per_rank[rank]
        torch.index_select(chunk, 0, idx, out=row.view(torch.float32)[: len(idx)])

    def read(self, row: torch.Tensor, rank: int) -> torch.Tensor:
        """The fp32 values ``write`` put into ``row`` for rank ``rank``'s chunk."""
        return row.view(torch.float32)[: len(self.per_rank[rank])]

    def overwrite(self, target: torch.Tensor, rank: int, values: torch.Tensor) -> None:
        """``target`` (rank ``rank``'s chunk, fp32) takes ``values`` at its positions."""
        target.index_copy_(0, self.per_rank[rank], values)
