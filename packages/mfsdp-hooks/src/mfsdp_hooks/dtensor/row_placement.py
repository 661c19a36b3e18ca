"""The placement a row-sharded DTensor shows torch: ``Shard(d)`` that knows where its rows are.

torch's state-dict helpers (``set_model_state_dict`` / ``set_optimizer_state_dict`` with
``broadcast_from_rank0``) copy ``full[offset : offset + size]`` into the local tensor, asking
each placement for its piece (``_local_shard_size_and_offset``). A plain ``Shard(d)`` answers
with ``torch.chunk``'s split, not the flat layout's rows: the copy fails on a size mismatch or,
where the sizes agree, silently loads another rank's rows. :class:`RowShard` equals
``Shard(d)`` (same hash, so sharding propagation and every ``placements == ...`` test treat it
as one) and answers that question from the ranges. ``RowShardedDTensor.placements`` returns
it; the spec DTensor's dispatch reads keeps the plain ``Shard(d)``, so no op result ever
carries another tensor's ranges.
"""

from __future__ import annotations

from torch.distributed import RankType
from torch.distributed.tensor import DTensor, Placement, Shard

__all__ = ["RowShard", "row_placements"]


class RowShard(Shard):
    """``Shard(dim)`` whose rank ``r`` of its mesh dim holds rows ``dp_row_ranges[r]``."""

    dp_row_ranges: tuple[tuple[int, int], ...]

    def __init__(self, dim: int, dp_row_ranges: tuple[tuple[int, int], ...]) -> None:
        super().__init__(dim)
        self.dp_row_ranges = dp_row_ranges

    def _local_shard_size_and_offset(
        self, curr_local_size: int, num_chunks: int, rank: RankType
    ) -> tuple[int, RankType]:
        rows = max(end for _, end in self.dp_row_ranges)
        if curr_local_size != rows or num_chunks != len(self.dp_row_ranges):
            raise ValueError(
                f"a row-sharded placement of {rows} rows over {len(self.dp_row_ranges)} ranks "
                f"was asked for a piece of {curr_local_size} rows over {num_chunks}: it "
                "describes one tensor's layout only"
            )
        start, end = self.dp_row_ranges[int(rank)]
        return end - start, start


def row_placements(
    tensor: DTensor, dp_row_ranges: tuple[tuple[int, int], ...], tp_partition_stride: int
) -> tuple[Placement, ...]:
    """``tensor``'s spec placements with mesh dim 0's ``Shard(d)`` as a :class:`RowShard`.

    Only where the ranges are rows of the full tensor's dim ``d``: no other mesh dim shards
    ``d`` (then the ranges are rows of the TP-local tensor) and the TP partition is not
    strided. Elsewhere the plain placements, whose slices only DCP's protocol
    (:mod:`.dcp_protocol`) and ``mfsdp_checkpoint`` know how to correct.
    """
    placements = tensor._spec.placements
    first = placements[0]
    if not isinstance(first, Shard) or tp_partition_stride != 1:
        return placements
    if any(isinstance(p, Shard) and p.dim == first.dim for p in placements[1:]):
        return placements
    return (RowShard(first.dim, dp_row_ranges), *placements[1:])
