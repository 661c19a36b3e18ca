"""Where a row-sharded DTensor's local rows sit in the full tensor, told to DCP.

DCP asks every DTensor it saves for its write items (``__create_write_items__``) and every
DTensor it loads into for its chunks (``__create_chunk_list__``). DTensor's own answer follows
``torch.chunk``'s split, not the flat layout's rows: rows land in the wrong place and a rank
whose piece is empty cannot load. A ``RowShardedDTensor`` answers from its ranges (these
functions), so plain ``dcp.save``/``dcp.load`` of a model's and a bare optimizer's state
dicts are exact. ``mfsdp_checkpoint``'s instance-level methods (Megatron strided partitions,
optimizer state of other shapes, dirty marks) take precedence.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    MetadataIndex,
    TensorProperties,
)
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

__all__ = ["row_chunks", "row_write_items"]


def row_chunks(
    tensor: DTensor, dp_row_ranges: Sequence[tuple[int, int]], tp_partition_stride: int
) -> list[ChunkStorageMetadata]:
    """This rank's piece of ``tensor`` (``Shard(d)`` on mesh dim 0, whose rank ``r`` holds
    rows ``dp_row_ranges[r]`` along ``d``) in the full tensor: one chunk, or none when empty.

    An empty piece is left out: its offset is its neighbour's, and two chunks at one offset
    collide in DCP's metadata. Only when every piece is empty (no rows at all) does each
    rank give its (equal, empty) chunk, so the tensor is still recorded.
    """
    if tp_partition_stride != 1:
        raise NotImplementedError(
            f"a DTensor of shape {tuple(tensor.shape)} from a strided tensor-parallel "
            f"partition (partition_stride={tp_partition_stride}) has rows in several "
            "places of the full tensor; checkpoint it through mfsdp_checkpoint: call "
            "mfsdp_checkpoint.enable_dcp(model, optimizer) once before state_dict()"
        )
    mesh, placements = tensor.device_mesh, tensor._spec.placements
    assert isinstance(placements[0], Shard)
    dim = placements[0].dim
    start, end = dp_row_ranges[mesh.get_local_rank(0)]
    if start == end and any(s != e for s, e in dp_row_ranges):
        return []
    # The offset of the tensor-parallel part, if any, is torch's; the rows inside it ours.
    _, offsets = compute_local_shape_and_global_offset(
        tensor.shape, mesh, [Replicate(), *placements[1:]]
    )
    base = list(offsets)
    base[dim] += start
    sizes = torch.Size(tensor._local_tensor.shape)
    return [ChunkStorageMetadata(offsets=torch.Size(base), sizes=sizes)]


def row_write_items(
    fqn: str, tensor: DTensor, chunks: list[ChunkStorageMetadata]
) -> list[WriteItem]:
    """DCP's write items for ``tensor``: a shard item at each of its ``chunks``."""
    return [
        WriteItem(
            index=MetadataIndex(fqn, chunk.offsets),
            type=WriteItemType.SHARD,
            tensor_data=TensorWriteData(
                chunk=chunk,
                properties=TensorProperties.create_from_tensor(tensor._local_tensor),
                size=tensor.shape,
            ),
        )
        for chunk in chunks
    ]
