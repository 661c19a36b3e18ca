"""Where each rank's piece of a sharded parameter sits in the full tensor, for DCP: the two DCP
protocol methods every state-dict tensor gets, answering from the layout's true row range
(why DCP needs them: the package README, "Why the layer is needed"). The ranges are pure
arithmetic on the layout, computed once per parameter group and cached for its life.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex
from torch.distributed.checkpoint.planner import WriteItem
from torch.distributed.tensor import DTensor

from mfsdp_hooks import ParameterGroup, ShardingStrategy, local_tensor, row_write_items

_WRITE_ATTR = "__create_write_items__"
_CHUNKS_ATTR = "__create_chunk_list__"
_SHARD_ATTR = "__get_tensor_shard__"


@dataclass(frozen=True)
class RowChunk:
    """This rank's rows ``[row_start, row_end)`` of a tensor of ``global_shape``.

    A tensor-parallel parameter's rows are rows of its TP-local tensor (``local_shape``),
    which starts at ``base`` in the global one; otherwise both are the global tensor.
    """

    global_shape: torch.Size
    row_start: int
    row_end: int
    writes: bool
    """False for an empty piece: writing it would collide with a neighbour's chunk offset."""
    base: tuple[int, ...] | None = None
    local_shape: torch.Size | None = None
    stride: int = 1
    """A strided TP partition (``TPSpec.partition_stride``): the TP-local rows are this many
    blocks, each at its own place in the global tensor; ``base`` is the first block's."""
    dim: int = 0
    """The dim the rows are along (FSDP2's ``Shard(dim)``; never with TP, so ``base`` is
    None when it is not 0)."""

    @property
    def offsets(self) -> torch.Size:
        base = list(self.base or (0,) * len(self.global_shape))
        base[self.dim] += self.row_start
        return torch.Size(base)

    @property
    def sizes(self) -> torch.Size:
        shape = list(self.local_shape if self.local_shape is not None else self.global_shape)
        shape[self.dim] = self.row_end - self.row_start
        return torch.Size(shape)

    def like(self, shape: torch.Size) -> RowChunk:
        """The same rows of a tensor of ``shape`` (optimizer state row-aligned with them)."""
        return RowChunk(shape, self.row_start, self.row_end, self.writes, dim=self.dim)

    def rows_of(self, full: torch.Tensor) -> torch.Tensor:
        """This chunk's rows of ``full``, a tensor of the (TP-local) shape: a view."""
        return full.narrow(self.dim, self.row_start, self.row_end - self.row_start)

    def storage(self) -> ChunkStorageMetadata:
        return ChunkStorageMetadata(offsets=self.offsets, sizes=self.sizes)

    def pieces(self) -> list[tuple[ChunkStorageMetadata, int, int]]:
        """Where this rank's rows go: ``(global chunk, first local row, end local row)`` per
        contiguous run (one unless the TP partition is strided); none for an empty piece."""
        if not self.writes:
            return []
        if self.stride == 1:
            return [(self.storage(), 0, self.row_end - self.row_start)]
        rows = (self.local_shape or self.global_shape)[0]
        block, global_block = rows // self.stride, self.global_shape[0] // self.stride
        base = self.base or (0,) * len(self.global_shape)
        out = []
        for k in range(self.stride):
            start, end = max(self.row_start, k * block), min(self.row_end, (k + 1) * block)
            if start >= end:
                continue
            row = k * global_block + base[0] + start - k * block
            storage = ChunkStorageMetadata(
                offsets=torch.Size([row, *base[1:]]),
                sizes=torch.Size([end - start, *self.sizes[1:]]),
            )
            out.append((storage, start - self.row_start, end - self.row_start))
        return out


_CACHE: weakref.WeakKeyDictionary[ParameterGroup, tuple[RowChunk, ...]] = (
    weakref.WeakKeyDictionary()
)


def group_chunks(group: ParameterGroup) -> tuple[RowChunk, ...]:
    """This rank's chunk of every parameter of ``group``; computed on first use, then cached."""
    cached = _CACHE.get(group)
    if cached is not None:
        return cached
    rank = group.topology.optim_rank  # the optimizer-facing shard (HFSDP: a sub-shard)
    chunks = []
    for index, (shape, spec) in enumerate(zip(group.shapes, group.tp_specs, strict=True)):
        size = torch.Size(shape)  # the TP-local shape for a tensor-parallel parameter
        whole, base, local = size, None, None
        if spec is not None:
            whole, base, local = spec.global_shape, spec.local_offset, size
        stride = spec.partition_stride if spec is not None else 1
        dim = group.optim_layout.placements[index].shard_dim
        if group.strategy == ShardingStrategy.NO_SHARD:
            start, end, writes = 0, size[dim], True
        elif size.numel() == 0:
            # Nothing to write anywhere; one rank still records the tensor so it has metadata.
            start, end, writes = 0, size[dim], rank == 0
        else:
            piece = group.optim_layout.local_piece(index, rank)
            start, end, writes = piece.row_start, piece.row_end, not piece.is_empty
        chunks.append(RowChunk(whole, start, end, writes, base, local, stride, dim))
    result = tuple(chunks)
    _CACHE[group] = result
    return result


class _WriteItems:
    """``__create_write_items__`` of one tensor: a SHARD item at each true row offset."""

    def __init__(self, chunk: RowChunk) -> None:
        self.chunk = chunk

    def __call__(self, fqn: str, obj: Any) -> list[WriteItem]:
        # ``obj``, not a bound tensor: a staged copy shares this object (copy_dcp_protocol).
        # Only DTensors are annotated, each of shape ``chunk.global_shape`` (annotate,
        # split_rows), so layer 3's items (sized by ``obj.shape``) are this chunk's.
        assert isinstance(obj, DTensor), "only DTensors carry mfsdp_checkpoint's DCP methods"
        return row_write_items(fqn, obj, [storage for storage, _, _ in self.chunk.pieces()])


class _TensorShard:
    """``__get_tensor_shard__`` of a tensor whose rows go to several places (a strided TP
    partition): DCP asks for each piece by its global offsets."""

    def __init__(self, chunk: RowChunk, tensor: torch.Tensor) -> None:
        self.chunk = chunk
        self.tensor = weakref.ref(tensor)

    def __call__(self, index: MetadataIndex) -> torch.Tensor:
        tensor = self.tensor()
        assert tensor is not None, "the state-dict tensor is gone"
        for storage, start, end in self.chunk.pieces():
            if index.offset is not None and tuple(storage.offsets) == tuple(index.offset):
                return local_tensor(tensor)[start:end]
        raise ValueError(f"no piece of this tensor starts at {index.offset}")


class _ChunkList:
    """``__create_chunk_list__`` of one tensor, called by DCP only when planning a load.

    A load rewrites the tensor in place behind the engine's back, so it also marks the owning
    group's weights dirty: the compute weights are re-installed at the next unshard even when
    the caller never calls ``model.load_state_dict`` after ``dcp.load``.
    """

    def __init__(self, chunk: RowChunk, on_load: Callable[[], None]) -> None:
        self.chunk = chunk
        self.on_load = on_load

    def __call__(self) -> list[ChunkStorageMetadata]:
        self.on_load()
        return [storage for storage, _, _ in self.chunk.pieces()]


def _row_chunk_for(tensor: DTensor, param_chunk: RowChunk) -> RowChunk | None:
    """The chunk of an optimizer-state tensor shaped like (or row-aligned with) its parameter."""
    shape = tensor.shape
    local = local_tensor(tensor).shape
    if shape == param_chunk.global_shape:
        return param_chunk
    dim = param_chunk.dim
    if (
        param_chunk.base is None
        and len(shape) > dim
        and shape[dim] == param_chunk.global_shape[dim]
        and local[dim] == (param_chunk.row_end - param_chunk.row_start)
    ):
        return param_chunk.like(torch.Size(shape))
    return None


def annotate(
    tensor: torch.Tensor, chunk: RowChunk, group: ParameterGroup, what: str
) -> torch.Tensor:
    """Give ``tensor`` (a DTensor over this rank's rows) the DCP methods for ``chunk``.

    ``chunk`` is the chunk of the parameter ``tensor`` belongs to; optimizer state that is
    row-aligned with it but of another shape gets a chunk of its own. Returns ``tensor``.
    """
    if not isinstance(tensor, DTensor):
        return tensor
    own = _row_chunk_for(tensor, chunk)
    if own is None:
        if all(p.is_replicate() for p in tensor.placements):
            return tensor  # DCP's own handling of replicated DTensors is right
        raise NotImplementedError(
            f"{what}: a sharded tensor of shape {tuple(tensor.shape)} is not row-aligned with "
            f"its parameter of shape {tuple(chunk.global_shape)}; mfsdp_checkpoint cannot place "
            "its rows in a checkpoint (use an optimizer whose state matches the parameter shape)"
        )
    if tuple(local_tensor(tensor).shape) != tuple(own.sizes) and own.global_shape.numel():
        raise RuntimeError(
            f"{what}: local tensor of shape {tuple(local_tensor(tensor).shape)} does not match "
            f"rows [{own.row_start}, {own.row_end}) of the layout; the engine's sharding changed "
            "under the checkpoint layer"
        )
    setattr(tensor, _WRITE_ATTR, _WriteItems(own))
    setattr(tensor, _CHUNKS_ATTR, _ChunkList(own, group.mark_weights_dirty))
    if own.stride > 1:
        setattr(tensor, _SHARD_ATTR, _TensorShard(own, tensor))
    return tensor


def has_row_chunk(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` is a state-dict tensor that carries its rows' place in the full
    tensor for DCP (what ``enable_dcp`` gives the sharded ones; :func:`split_rows` takes it)."""
    return isinstance(tensor.__dict__.get(_CHUNKS_ATTR), _ChunkList)


def chunk_of(tensor: torch.Tensor) -> RowChunk | None:
    found = tensor.__dict__.get(_CHUNKS_ATTR)
    return found.chunk if isinstance(found, _ChunkList) else None


def split_rows(tensor: torch.Tensor, parts: int, what: str) -> list[torch.Tensor]:
    """``tensor`` (annotated) as ``parts`` tensors: the k-th holds the k-th of ``parts`` equal
    consecutive blocks of each tensor-parallel rank's rows, stacked over the TP ranks.

    This is how Megatron-LM saves a SwiGLU ``linear_fc1`` (each TP rank's rows are its
    ``[w; v]``): as ``_w`` and ``_v``, whose layout does not depend on TP. The pieces are views
    of this rank's rows, so a load into them fills ``tensor``.
    """
    found = tensor.__dict__.get(_CHUNKS_ATTR)
    if not isinstance(found, _ChunkList) or not isinstance(tensor, DTensor):
        raise TypeError(f"{what}: not a sharded state-dict tensor of mfsdp_checkpoint")
    chunk = found.chunk
    local_shape = chunk.local_shape if chunk.local_shape is not None else chunk.global_shape
    rows = local_shape[0]
    if rows % parts:
        raise ValueError(f"{what}: {rows} rows per tensor-parallel rank do not split in {parts}")
    block, tp = rows // parts, chunk.global_shape[0] // rows
    tp_rank = (chunk.base[0] if chunk.base else 0) // (rows // chunk.stride)
    local = local_tensor(tensor)
    pieces: list[torch.Tensor] = []
    for k in range(parts):
        start = min(max(chunk.row_start, k * block), (k + 1) * block)
        end = max(min(chunk.row_end, (k + 1) * block), start)
        shape = torch.Size([tp * block, *local_shape[1:]])
        base = (tp_rank * block, *[0] * (len(shape) - 1)) if tp > 1 else None
        own = RowChunk(
            shape,
            start - k * block,
            end - k * block,
            chunk.writes and end > start,
            base,
            torch.Size([block, *local_shape[1:]]) if tp > 1 else None,
        )
        view = local[start - chunk.row_start : end - chunk.row_start]
        stride = torch.empty(shape, device="meta").stride()
        piece = DTensor.from_local(
            view,
            tensor.device_mesh,
            tensor._spec.placements,  # a row-sharded one's RowShard describes ``tensor`` only
            run_check=False,
            shape=shape,
            stride=stride,
        )
        setattr(piece, _WRITE_ATTR, _WriteItems(own))
        setattr(piece, _CHUNKS_ATTR, _ChunkList(own, found.on_load))
        pieces.append(piece)
    return pieces


def copy_dcp_protocol(source: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Give ``target`` (a copy of ``source``) the DCP methods ``annotate`` gave ``source``.

    They live in the instance's ``__dict__``, which no tensor copy carries over; without them
    DCP would fall back to ``torch.chunk`` offsets and write uneven rows to the wrong place.
    The write and chunk methods hold only the row range, never the tensor, so sharing them is
    safe; a strided tensor's ``__get_tensor_shard__`` reads rows, so the copy gets its own.
    """
    for attr in (_WRITE_ATTR, _CHUNKS_ATTR):
        if attr in source.__dict__:
            setattr(target, attr, source.__dict__[attr])
    shard = source.__dict__.get(_SHARD_ATTR)
    if isinstance(shard, _TensorShard):  # it reads its own tensor's rows: bind the copy's
        setattr(target, _SHARD_ATTR, _TensorShard(shard.chunk, target))
    return target
