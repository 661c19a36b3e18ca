"""Whole matrices for an optimizer step that needs them, from parameters sharded by rows.

:func:`map_whole_matrices` brings each matrix whole to one rank of its shard group (its
*owner*), runs the caller's function there, and gives every rank its rows of the result. Per
shard group and dtype, in the order the matrices come (the same on every rank): owners are
chosen by cost, largest first, each to the least loaded rank (:func:`plan_owners`); one
all-to-all brings each owner the others' rows of its matrices (each row crosses the wire
once, no rank sends itself anything); the owners compute; one all-to-all in the result
dtype sends each rank its rows back. Where the rows are, a DTensor's layout says
(:func:`rows_of`): ours carry each rank's rows, a plain ``Shard(d)`` (FSDP2) has
``torch.chunk``'s, a replicated tensor is computed on every rank; a matrix also split over
a second mesh dim (tensor parallelism) is refused by name.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate, Shard

from mfsdp_collectives import all_to_all_into
from mfsdp_hooks.dtensor.dtensor_views import local_tensor
from mfsdp_hooks.dtensor.row_sharded import RowShardedDTensor

__all__ = ["MatrixRows", "map_whole_matrices", "plan_owners", "rows_of"]


@dataclass(frozen=True)
class MatrixRows:
    """This rank's rows of a matrix, and where every rank's lie."""

    local: torch.Tensor
    """This rank's rows, cut along ``dim`` (the whole matrix when ``group`` is None)."""
    shape: torch.Size
    dim: int
    ranges: tuple[tuple[int, int], ...]
    """``[start, end)`` along ``dim`` held by each rank of ``group``, in group-rank order."""
    group: dist.ProcessGroup | None

    def with_local(self, local: torch.Tensor) -> MatrixRows:
        """The same layout over other values (an update laid out as its parameter)."""
        return MatrixRows(local, self.shape, self.dim, self.ranges, self.group)


def _chunk_ranges(rows: int, parts: int) -> tuple[tuple[int, int], ...]:
    """``torch.chunk``'s split of ``rows`` into ``parts``: what a plain ``Shard`` claims."""
    size = -(-rows // parts)
    return tuple((min(i * size, rows), min((i + 1) * size, rows)) for i in range(parts))


def rows_of(tensor: torch.Tensor, name: str) -> MatrixRows:
    """Where ``tensor``'s rows lie (``name`` says which parameter, in a refusal)."""
    if not isinstance(tensor, DTensor):
        return MatrixRows(tensor, tensor.shape, 0, ((0, tensor.shape[0]),), None)
    mesh, placements = tensor.device_mesh, tensor.placements
    local = local_tensor(tensor)
    if any(not isinstance(p, Replicate) for p in placements[1:]) or not isinstance(
        placements[0], (Replicate, Shard)
    ):
        raise ValueError(
            f"{name!r} is laid out as {tuple(placements)} over a mesh of shape "
            f"{tuple(mesh.shape)}: split over more than its shard group (tensor or expert "
            "parallel), which a whole-matrix update does not support yet; give it to an "
            "element-wise optimizer (AdamW) instead"
        )
    placement = placements[0]
    if isinstance(placement, Replicate) or mesh.size(0) == 1:
        return MatrixRows(local, tensor.shape, 0, ((0, tensor.shape[0]),), None)
    dim = placement.dim
    if isinstance(tensor, RowShardedDTensor):
        ranges = tensor.dp_row_ranges
    else:
        ranges = _chunk_ranges(tensor.shape[dim], mesh.size(0))
    return MatrixRows(local, tensor.shape, dim, ranges, mesh.get_group(0))


def plan_owners(costs: Sequence[int], size: int) -> list[int]:
    """An owner rank for each cost: largest first, each to the least loaded rank so far
    (ties: the lower index, then the lower rank), the same on every rank."""
    least_loaded = [(0, rank) for rank in range(size)]  # a heap of (work so far, rank)
    owners = [0] * len(costs)
    for index in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        load, rank = heapq.heappop(least_loaded)
        owners[index] = rank
        heapq.heappush(least_loaded, (load + costs[index], rank))
    return owners


def _moved(tensor: torch.Tensor, dim: int) -> torch.Tensor:
    """Rows along ``dim`` as dim 0, contiguous: how rows travel."""
    return tensor.movedim(dim, 0).contiguous()


def _row_numel(matrix: MatrixRows) -> int:
    return matrix.shape.numel() // max(matrix.shape[matrix.dim], 1)


@dataclass(frozen=True)
class _Exchange:
    """One shard group's matrices of one dtype, and who owns each."""

    matrices: list[tuple[int, MatrixRows]]
    owners: list[int]
    group: dist.ProcessGroup
    result_dtype: torch.dtype

    def counts(self, rank: int, size: int) -> tuple[list[int], list[int]]:
        """Elements ``rank`` sends each rank and receives from each when the rows go to
        their owners (the results come back the other way: the same counts swapped)."""
        send, recv = [0] * size, [0] * size
        for (_, matrix), owner in zip(self.matrices, self.owners, strict=True):
            if owner != rank:
                start, end = matrix.ranges[rank]
                send[owner] += (end - start) * _row_numel(matrix)
                continue
            for holder, (start, end) in enumerate(matrix.ranges):
                if holder != rank:
                    recv[holder] += (end - start) * _row_numel(matrix)
        return send, recv


def _wholes(exchange: _Exchange, rank: int, size: int) -> list[torch.Tensor | None]:
    """Step 2: each of this rank's owned matrices whole, the others ``None``."""
    mine = exchange.owners
    send = torch.cat(
        [
            _moved(matrix.local, matrix.dim).view(-1)
            for dest in range(size)
            if dest != rank
            for (_, matrix), owner in zip(exchange.matrices, mine, strict=True)
            if owner == dest
        ]
        or [exchange.matrices[0][1].local.new_empty(0)]
    )
    send_counts, recv_counts = exchange.counts(rank, size)
    recv = send.new_empty(sum(recv_counts))
    all_to_all_into(send[: sum(send_counts)], send_counts, recv, recv_counts, exchange.group)
    offsets = [sum(recv_counts[:s]) for s in range(size)]
    wholes: list[torch.Tensor | None] = []
    for (_, matrix), owner in zip(exchange.matrices, mine, strict=True):
        if owner != rank:
            wholes.append(None)
            continue
        moved_shape = (matrix.shape[matrix.dim], *_moved(matrix.local, matrix.dim).shape[1:])
        whole = matrix.local.new_empty(moved_shape)
        for source, (start, end) in enumerate(matrix.ranges):
            if source == rank:
                whole[start:end] = _moved(matrix.local, matrix.dim)
                continue
            numel = (end - start) * _row_numel(matrix)
            piece = recv[offsets[source] : offsets[source] + numel]
            whole[start:end] = piece.view(end - start, *moved_shape[1:])
            offsets[source] += numel
        wholes.append(whole.movedim(0, matrix.dim))
    return wholes


def _scatter_results(
    exchange: _Exchange, results: list[torch.Tensor | None], rank: int, size: int
) -> list[torch.Tensor]:
    """Step 4: this rank's rows of every result, laid out as its ``local`` (the results this
    rank computed are all of one dtype, as are those it receives)."""
    pieces = [
        _moved(result, matrix.dim)[slice(*matrix.ranges[dest])].reshape(-1)
        for dest in range(size)
        if dest != rank
        for (_, matrix), result in zip(exchange.matrices, results, strict=True)
        if result is not None
    ]
    dtype = exchange.result_dtype
    send = torch.cat(pieces) if pieces else exchange.matrices[0][1].local.new_empty(0, dtype=dtype)
    recv_counts, send_counts = exchange.counts(rank, size)  # the way back
    recv = send.new_empty(sum(recv_counts))
    all_to_all_into(send, send_counts, recv, recv_counts, exchange.group)
    offsets = [sum(recv_counts[:s]) for s in range(size)]
    rows = []
    for (_, matrix), owner, result in zip(exchange.matrices, exchange.owners, results, strict=True):
        start, end = matrix.ranges[rank]
        if result is not None:
            mine = _moved(result, matrix.dim)[start:end]
        else:
            numel = (end - start) * _row_numel(matrix)
            local_shape = (end - start, *_moved(matrix.local, matrix.dim).shape[1:])
            mine = recv[offsets[owner] : offsets[owner] + numel].view(local_shape)
            offsets[owner] += numel
        rows.append(mine.movedim(0, matrix.dim))
    return rows


def map_whole_matrices(
    matrices: Sequence[MatrixRows],
    compute: Callable[[int, torch.Tensor], torch.Tensor],
    cost: Callable[[torch.Size], int],
    result_dtype: torch.dtype,
) -> list[torch.Tensor]:
    """``compute(i, whole matrix i)`` on one rank of each matrix's group (every rank, for a
    matrix that is whole everywhere), and this rank's rows of each result, in
    ``result_dtype``, laid out as ``matrices[i].local``. Collective over every group the
    matrices name: call it on every rank with matrices of the same layouts, in one order."""
    out: list[torch.Tensor | None] = [None] * len(matrices)
    exchanges: dict[tuple[int, torch.dtype], list[tuple[int, MatrixRows]]] = {}
    for index, matrix in enumerate(matrices):
        if matrix.group is None:
            out[index] = compute(index, matrix.local).to(result_dtype)
        else:  # keyed in first-seen order: the same on every rank
            exchanges.setdefault((id(matrix.group), matrix.local.dtype), []).append((index, matrix))
    for members in exchanges.values():
        group = members[0][1].group
        assert group is not None
        rank, size = dist.get_rank(group), dist.get_world_size(group)
        owners = plan_owners([cost(m.shape) for _, m in members], size)
        exchange = _Exchange(members, owners, group, result_dtype)
        wholes = _wholes(exchange, rank, size)
        results = [
            None if whole is None else compute(index, whole).to(result_dtype)
            for (index, _), whole in zip(members, wholes, strict=True)
        ]
        for (index, _), rows in zip(
            members, _scatter_results(exchange, results, rank, size), strict=True
        ):
            out[index] = rows
    assert all(o is not None for o in out)
    return [o for o in out if o is not None]
