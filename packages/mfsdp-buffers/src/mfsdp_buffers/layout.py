"""Row-aligned flat layout: where each parameter lives in a flat buffer and on which rank.

A shard boundary that falls strictly inside a parameter falls on a *row* edge of it (a row
is everything but the first dimension), so each rank's piece is a contiguous row range: an
uneven ``Shard(0)`` slice (why: the package README, "Why row-aligned?").

A parameter may be sharded along another dim ``d`` (FSDP2's ``Shard(d)``): it is
stored with ``d`` moved first (``stored_shape``), so its "rows" are slices along ``d``
and every view of it handed out is that storage with ``d`` moved back
(:meth:`ParamPlacement.rows_view`): the user's shape, not contiguous. The
packing arithmetic below only ever sees row counts and row sizes.

Everything here is pure arithmetic on shapes: no tensors, no process groups.
Every rank computes the same layout from the same inputs.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from mfsdp_buffers._arith import align_up, ceil_div, smallest_aligned_shift


@dataclass(frozen=True)
class ParamPlacement:
    """Where one parameter sits in the unsharded flat buffer."""

    index: int
    shape: torch.Size
    offset: int
    """First element of the parameter in the unsharded flat buffer."""
    numel: int
    row_numel: int
    """Elements per row, the product of every dim but ``shard_dim`` (1 for 1-D parameters,
    0 if another dim is 0)."""
    shard_dim: int = 0
    """The dim the parameter is cut along (its "rows"); stored first in the flat buffer."""

    @property
    def num_rows(self) -> int:
        """Size of the sharded dimension: the unit in which the parameter is sharded."""
        return self.shape[self.shard_dim]

    @property
    def stored_shape(self) -> torch.Size:
        """The shape it is stored in: ``shape`` with ``shard_dim`` moved first."""
        d = self.shard_dim
        return torch.Size([self.shape[d], *self.shape[:d], *self.shape[d + 1 :]])

    def rows_view(self, flat: torch.Tensor, num_rows: int | None = None) -> torch.Tensor:
        """``flat`` (``num_rows`` stored rows, all of them by default) viewed in the user's
        dim order: zero-copy, contiguous only when ``shard_dim`` is 0."""
        rows = self.num_rows if num_rows is None else num_rows
        stored = flat.view(rows, *self.stored_shape[1:])
        return stored if self.shard_dim == 0 else stored.movedim(0, self.shard_dim)

    def rows_of(self, tensor: torch.Tensor, row_start: int, row_end: int) -> torch.Tensor:
        """Rows ``[row_start, row_end)`` of a tensor of the user's shape (a view)."""
        return tensor.narrow(self.shard_dim, row_start, row_end - row_start)

    def flatten(self, tensor: torch.Tensor) -> torch.Tensor:
        """A tensor of the user's shape (or some of its rows) in storage order, 1-D (a copy
        only when ``shard_dim`` is not 0)."""
        stored = tensor if self.shard_dim == 0 else tensor.movedim(self.shard_dim, 0)
        return stored.reshape(-1)

    @property
    def end(self) -> int:
        """One past the last element of the parameter in the unsharded flat buffer."""
        return self.offset + self.numel


@dataclass(frozen=True)
class LocalPiece:
    """One parameter's piece on one rank: a contiguous row range, possibly empty."""

    param_index: int
    rank: int
    row_start: int
    row_end: int
    shard_offset: int
    """Where the piece starts in that rank's shard (clamped into ``[0, shard_numel]`` if empty)."""
    numel: int

    @property
    def is_empty(self) -> bool:
        """True when the rank holds no row of the parameter."""
        return self.row_start == self.row_end

    @property
    def num_rows(self) -> int:
        """Number of rows held by the rank."""
        return self.row_end - self.row_start


def _normalize_shape(index: int, shape: Sequence[int] | torch.Size) -> torch.Size:
    try:
        dims = [operator.index(d) for d in shape]
    except TypeError as exc:
        raise TypeError(
            f"shapes[{index}] must be a sequence of ints or a torch.Size, got {shape!r}"
        ) from exc
    if not dims:
        raise ValueError(
            f"parameter {index} is 0-d: 0-d parameters cannot be sharded; reshape to (1,)"
        )
    if any(d < 0 for d in dims):
        raise ValueError(f"shapes[{index}] has a negative dimension: {tuple(dims)}")
    return torch.Size(dims)


def _shard_dim(index: int, shape: torch.Size, dim: int) -> int:
    if isinstance(dim, bool) or not isinstance(dim, int) or not -len(shape) <= dim < len(shape):
        raise ValueError(
            f"shard_dims[{index}]={dim!r} is not a dim of a parameter of shape {tuple(shape)}"
        )
    return dim % len(shape)


def _row_numel(shape: torch.Size, dim: int) -> int:
    return math.prod(shape[:dim]) * math.prod(shape[dim + 1 :])


@dataclass(frozen=True)
class FlatLayout:
    """A deterministic row-aligned packing of parameters into ``world_size`` equal shards.

    Build it with :meth:`build`. Invariants (checked on construction):

    * every parameter lies inside ``[0, padded_numel)``, parameters appear in
      index order, never overlap, and start at a multiple of ``alignment``;
    * ``shard_numel`` is a multiple of ``alignment``, so every shard starts aligned;
    * every shard boundary strictly inside a parameter is on one of its row edges.

    Padding bound (proved in :meth:`build`, property-tested): with
    ``U = data_numel + sum_i (lcm(alignment, max(row_numel_i, 1)) - 1)`` and
    ``step0 = lcm(alignment, {row_numel_i : numel_i > ceil(data_numel / world_size)})``::

        padded_numel <= U + world_size * step0 - 1
    """

    placements: tuple[ParamPlacement, ...]
    world_size: int
    alignment: int
    shard_numel: int

    def __post_init__(self) -> None:
        if self.world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {self.world_size}")
        if self.alignment < 1:
            raise ValueError(f"alignment must be >= 1, got {self.alignment}")
        if self.shard_numel < 0 or self.shard_numel % self.alignment:
            raise ValueError(
                f"shard_numel must be a non-negative multiple of alignment={self.alignment}, "
                f"got {self.shard_numel}"
            )
        cursor = 0
        for i, p in enumerate(self.placements):
            if p.index != i:
                raise ValueError(f"placements[{i}] has index {p.index}; expected {i}")
            if p.offset < cursor or p.offset % self.alignment or p.end > self.padded_numel:
                raise ValueError(f"placement {i} at offset {p.offset} is misplaced or misaligned")
            cursor = p.end
            if p.numel and self.shard_numel:
                first = (p.offset // self.shard_numel + 1) * self.shard_numel
                for boundary in range(first, p.end, self.shard_numel):
                    if (boundary - p.offset) % p.row_numel:
                        raise ValueError(
                            f"shard boundary {boundary} cuts parameter {i} (shape "
                            f"{tuple(p.shape)}) inside a row"
                        )

    # ------------------------------------------------------------------ build

    @classmethod
    def build(
        cls,
        shapes: Sequence[Sequence[int] | torch.Size],
        world_size: int,
        alignment: int = 1,
        shard_dims: Sequence[int] | None = None,
    ) -> FlatLayout:
        """Pack ``shapes`` in order; pick the smallest ``shard_numel`` the packing allows.

        ``alignment`` is in elements: every parameter and every shard starts at a
        multiple of it (use it for vectorised kernels or collective alignment).
        ``shard_dims`` (default all 0): the dim each parameter is cut along.

        Algorithm, for a candidate shard size ``S``:

        * a parameter with more than ``S`` elements can contain two boundaries,
          ``S`` apart, so ``S`` must be a multiple of its ``row_numel``:
          ``S`` must be a multiple of ``step(S) = lcm(alignment, row_numel of those)``;
        * parameters are placed in order at aligned offsets; one whose first
          interior boundary is mid-row is pushed forward by the smallest aligned
          shift that puts the boundary on a row edge (``< lcm(alignment, row_numel)``;
          the boundary itself is always a solution, so the parameter never jumps
          past it; with ``S`` as above the other boundaries then line up too);
        * if the packing ends past ``world_size * S``, ``S`` grows to at least
          ``ceil(end / world_size)`` and the smallest feasible value from there is tried.

        Why the padding bound in the class docstring holds: each parameter costs at
        most ``lcm(alignment, row_numel) - 1`` padding, so every packing ends at or
        before ``U``. A candidate that fails satisfies ``world_size * S < U``, so the
        next candidate starts from some ``x <= ceil(U / world_size)`` and lands at most
        ``step(x) - 1 <= step0 - 1`` above it; hence the final ``S`` is
        ``<= ceil(U / world_size) + step0 - 1``.
        """
        if isinstance(world_size, bool) or operator.index(world_size) < 1:
            raise ValueError(f"world_size must be an int >= 1, got {world_size!r}")
        if isinstance(alignment, bool) or operator.index(alignment) < 1:
            raise ValueError(f"alignment must be an int >= 1, got {alignment!r}")
        norm = [_normalize_shape(i, s) for i, s in enumerate(shapes)]
        if shard_dims is None:
            shard_dims = [0] * len(norm)
        if len(shard_dims) != len(norm):
            raise ValueError(f"shard_dims has {len(shard_dims)} dims for {len(norm)} shapes")
        dims = [_shard_dim(i, s, d) for i, (s, d) in enumerate(zip(norm, shard_dims, strict=True))]
        numels = [math.prod(s) for s in norm]
        rows = [_row_numel(s, d) for s, d in zip(norm, dims, strict=True)]
        data_numel = sum(numels)

        shard = _smallest_feasible(ceil_div(data_numel, world_size), numels, rows, alignment)
        while True:
            offsets, end = _place(shard, world_size, numels, rows, alignment)
            if end <= world_size * shard:
                break
            start = max(shard + 1, ceil_div(end, world_size))
            shard = _smallest_feasible(start, numels, rows, alignment)

        placements = tuple(
            ParamPlacement(index=i, shape=s, offset=o, numel=n, row_numel=r, shard_dim=d)
            for i, (s, o, n, r, d) in enumerate(zip(norm, offsets, numels, rows, dims, strict=True))
        )
        return cls(
            placements=placements,
            world_size=world_size,
            alignment=alignment,
            shard_numel=shard,
        )

    def merged(self, factor: int) -> FlatLayout:
        """The same packing cut into ``world_size // factor`` shards, shard ``r`` being this
        layout's shards ``r * factor`` to ``r * factor + factor - 1``.

        HFSDP builds its layout over ``shard x outer`` sub-shards and merges it by ``outer``:
        a ``dp_shard`` rank's compute shard is then exactly its ``dp_outer`` peers' sub-shards.
        """
        if isinstance(factor, bool) or operator.index(factor) < 1 or self.world_size % factor:
            raise ValueError(
                f"factor={factor!r} must be a positive divisor of world_size={self.world_size}"
            )
        return FlatLayout(
            placements=self.placements,
            world_size=self.world_size // factor,
            alignment=self.alignment,
            shard_numel=self.shard_numel * factor,
        )

    # ------------------------------------------------------------- accessors

    @property
    def num_params(self) -> int:
        return len(self.placements)

    @property
    def padded_numel(self) -> int:
        """Elements in the unsharded buffer, padding included (``shard_numel * world_size``)."""
        return self.shard_numel * self.world_size

    @property
    def data_numel(self) -> int:
        """Elements that belong to parameters (no padding)."""
        return sum(p.numel for p in self.placements)

    def data_numel_per_rank(self) -> tuple[int, ...]:
        """Elements of parameters (no padding) in each rank's shard, in rank order: what
        sets a rank's optimizer state apart from its peers' (the shards are equal in size).
        Each parameter touches only the shards it spans, so a world of 1024 costs little."""
        counts = [0] * self.world_size
        size = self.shard_numel
        for p in self.placements:
            if size == 0 or p.numel == 0:
                continue
            for shard in range(p.offset // size, (p.end - 1) // size + 1):
                start, stop = shard * size, (shard + 1) * size
                counts[shard] += min(stop, p.end) - max(start, p.offset)
        return tuple(counts)

    def shard_range(self, rank: int) -> tuple[int, int]:
        """``[start, end)`` of ``rank``'s shard in the unsharded buffer."""
        self._check_rank(rank)
        return rank * self.shard_numel, (rank + 1) * self.shard_numel

    def local_piece(self, param_index: int, rank: int) -> LocalPiece:
        """The rows of parameter ``param_index`` that live in ``rank``'s shard."""
        self._check_rank(rank)
        if not 0 <= param_index < len(self.placements):
            raise IndexError(f"param_index {param_index} out of range [0, {self.num_params})")
        p = self.placements[param_index]
        shard_start = rank * self.shard_numel
        if p.row_numel == 0:
            # Rows of zero elements: any split is valid; give them all to the rank
            # that owns the parameter's offset so the ranges still tile in rank order.
            owner = (
                min(p.offset // self.shard_numel, self.world_size - 1) if self.shard_numel else 0
            )
            row_start = 0 if rank <= owner else p.num_rows
            row_end = p.num_rows if rank >= owner else 0
            shard_offset = min(max(p.offset - shard_start, 0), self.shard_numel)
            return LocalPiece(param_index, rank, row_start, row_end, shard_offset, 0)
        lo, hi = self._span_in_shard(p, shard_start)
        shard_offset = min(max(p.offset + lo - shard_start, 0), self.shard_numel)
        return LocalPiece(
            param_index=param_index,
            rank=rank,
            row_start=lo // p.row_numel,
            row_end=hi // p.row_numel,
            shard_offset=shard_offset,
            numel=hi - lo,
        )

    def _span_in_shard(self, p: ParamPlacement, shard_start: int) -> tuple[int, int]:
        """``[lo, hi)``: the elements of ``p`` in the shard starting at ``shard_start``."""
        lo = min(max(shard_start - p.offset, 0), p.numel)
        hi = min(max(shard_start + self.shard_numel - p.offset, 0), p.numel)
        return lo, hi

    def local_pieces(self, rank: int) -> tuple[LocalPiece, ...]:
        """One piece per parameter, in parameter order, empty pieces included."""
        return tuple(self.local_piece(i, rank) for i in range(len(self.placements)))

    def row_ranges(self, param_index: int) -> tuple[tuple[int, int], ...]:
        """``(row_start, row_end)`` of the parameter on every rank, in rank order.

        This is the per-rank split of dimension 0, which is what uneven DTensor
        metadata (and DCP) need; it costs no communication. Ranks whose shards end before
        the parameter hold ``(0, 0)``, those starting after it ``(rows, rows)``: only the
        few shards it spans are worked out (``local_piece``'s rule), so a wrap over a world
        of thousands stays cheap.
        """
        p = self.placements[param_index]
        if p.row_numel == 0 or p.numel == 0 or self.shard_numel == 0:
            return tuple(
                (piece.row_start, piece.row_end)
                for piece in (self.local_piece(param_index, r) for r in range(self.world_size))
            )
        first = min(p.offset // self.shard_numel, self.world_size - 1)
        last = min((p.offset + p.numel - 1) // self.shard_numel, self.world_size - 1)
        spans = (self._span_in_shard(p, r * self.shard_numel) for r in range(first, last + 1))
        return (
            ((0, 0),) * first
            + tuple((lo // p.row_numel, hi // p.row_numel) for lo, hi in spans)
            + ((p.num_rows, p.num_rows),) * (self.world_size - last - 1)
        )

    def padding_gaps(self) -> tuple[tuple[int, int], ...]:
        """The ``[start, end)`` ranges of the flat buffer that belong to no parameter."""
        gaps: list[tuple[int, int]] = []
        cursor = 0
        for placement in self.placements:
            if placement.offset > cursor:
                gaps.append((cursor, placement.offset))
            cursor = max(cursor, placement.offset + placement.numel)
        if cursor < self.padded_numel:
            gaps.append((cursor, self.padded_numel))
        return tuple(gaps)

    def _check_rank(self, rank: int) -> None:
        if not 0 <= rank < self.world_size:
            raise IndexError(f"rank {rank} out of range [0, {self.world_size})")


def _step(shard: int, numels: Sequence[int], rows: Sequence[int], alignment: int) -> int:
    """Granularity ``shard`` must respect: rows of every parameter that may span 2+ boundaries."""
    return math.lcm(alignment, *(r for n, r in zip(numels, rows, strict=True) if n > shard))


def _smallest_feasible(
    start: int, numels: Sequence[int], rows: Sequence[int], alignment: int
) -> int:
    """Smallest ``S >= start`` that is a multiple of ``_step(S)``.

    ``_step`` only changes where ``S`` crosses a parameter's numel, so it is
    constant on the intervals between those thresholds; the answer is the first
    interval's own aligned start that still lies inside it. Growing ``S`` past a
    big parameter can be much cheaper than aligning to the lcm of odd row sizes.
    """
    thresholds = sorted({n for n in numels if n > start})
    lo = start
    for hi in [*thresholds, None]:
        candidate = align_up(lo, _step(lo, numels, rows, alignment))
        if hi is None or candidate < hi:
            return candidate
        lo = hi
    raise AssertionError("unreachable: the last interval is unbounded")


def _place(
    shard: int, world_size: int, numels: Sequence[int], rows: Sequence[int], alignment: int
) -> tuple[list[int], int]:
    """Offsets of every parameter for shard size ``shard``, and the end of the packing.

    Only interior boundaries (``k * shard`` for ``0 < k < world_size``) move a
    parameter; one that runs past the buffer end just makes the packing too long.
    """
    offsets: list[int] = []
    cursor = 0
    for n, r in zip(numels, rows, strict=True):
        offset = align_up(cursor, alignment)
        if n and shard:
            boundary = (offset // shard + 1) * shard
            if boundary < min(offset + n, world_size * shard):
                offset += smallest_aligned_shift(offset, boundary, alignment, r)
        offsets.append(offset)
        cursor = offset + n
    return offsets, cursor
