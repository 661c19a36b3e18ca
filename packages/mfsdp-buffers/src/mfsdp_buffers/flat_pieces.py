"""A flat vector held as separate pieces, zero wherever no piece lies (per-parameter
gradients at their layout offsets): a collective that copies chunk by chunk anyway reads
them without a flat copy first.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence

import torch

__all__ = ["FlatPieces"]


class FlatPieces:
    """``numel`` elements of ``dtype``: ``pieces[i]`` at ``offsets[i]``, zeros elsewhere.

    Pieces are 1-D, may be of another dtype (reads cast) and must not overlap.
    """

    def __init__(
        self,
        numel: int,
        pieces: Sequence[tuple[int, torch.Tensor]],
        *,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        ordered = sorted(pieces, key=lambda item: item[0])
        cursor = 0
        for offset, piece in ordered:
            if piece.dim() != 1:
                raise ValueError(f"pieces must be 1-D, got shape {tuple(piece.shape)}")
            if offset < cursor or offset + piece.numel() > numel:
                raise ValueError(
                    f"piece at offset {offset} with {piece.numel()} elements overlaps another "
                    f"or runs past numel={numel}"
                )
            if piece.device != device:
                raise ValueError(f"piece on {piece.device} but the vector is on {device}")
            cursor = offset + piece.numel()
        self.numel = numel
        self.dtype = dtype
        self.device = device
        self._offsets = [offset for offset, _ in ordered]
        self._ends = [offset + piece.numel() for offset, piece in ordered]
        self._pieces = [piece for _, piece in ordered]

    @property
    def pieces(self) -> list[torch.Tensor]:
        """The pieces, in offset order."""
        return list(self._pieces)

    def _overlapping(self, start: int, stop: int) -> range:
        first = bisect.bisect_right(self._ends, start)
        last = bisect.bisect_left(self._offsets, stop)
        return range(first, last)

    def copy_range_into(self, dst: torch.Tensor, start: int) -> None:
        """``dst[:] = self[start : start + dst.numel()]``: one ``cat`` per run of adjacent
        pieces (not one copy per piece: a unit of many small parameters is one op), zeros
        in the gaps."""
        stop = start + dst.numel()
        run: list[torch.Tensor] = []
        run_start = cursor = start
        for i in self._overlapping(start, stop):
            lo, hi = max(self._offsets[i], start), min(self._ends[i], stop)
            if lo > cursor:
                _write_run(dst, run, run_start - start, cursor - start)
                dst[cursor - start : lo - start].zero_()
                run, run_start = [], lo
            piece, offset = self._pieces[i], self._offsets[i]
            whole = lo == offset and hi == self._ends[i]
            run.append(piece if whole else piece[lo - offset : hi - offset])
            cursor = hi
        _write_run(dst, run, run_start - start, cursor - start)
        if cursor < stop:
            dst[cursor - start :].zero_()

    def add_range_into(self, dst: torch.Tensor, start: int) -> None:
        """``dst += self[start : start + dst.numel()]`` (gaps add nothing)."""
        stop = start + dst.numel()
        for i in self._overlapping(start, stop):
            lo, hi = max(self._offsets[i], start), min(self._ends[i], stop)
            dst[lo - start : hi - start].add_(
                self._pieces[i][lo - self._offsets[i] : hi - self._offsets[i]]
            )

    def materialize(self) -> torch.Tensor:
        """The whole vector as one new flat tensor."""
        flat = torch.empty(self.numel, dtype=self.dtype, device=self.device)
        self.copy_range_into(flat, 0)
        return flat


def _write_run(dst: torch.Tensor, run: list[torch.Tensor], begin: int, end: int) -> None:
    """``dst[begin:end]`` = the pieces of ``run`` one after another (cast to ``dst``'s dtype)."""
    if not run:
        return
    target = dst if begin == 0 and end == dst.numel() else dst[begin:end]
    if len(run) == 1:
        target.copy_(run[0])
    else:
        torch.cat(run, out=target)
