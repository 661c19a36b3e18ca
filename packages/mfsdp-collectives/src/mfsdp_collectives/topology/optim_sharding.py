"""Where the optimizer-facing shards live: the shard group, or under HFSDP (Megatron-FSDP's
``outer_dp_sharding_strategy="optim"``) the ranks of the flattened ``(dp_outer, dp_shard)``
submesh, sub-shard ``shard_rank * outer_size + outer_rank`` each (the package README's
"HFSDP"). That group orders its ranks by global rank, not sub-shard order:
``index_of_group_rank`` translates, for code that gathers every sub-shard.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import cast

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from ..core._compat import concatenate_meshes, flatten_mesh
from ..core.fake import is_fake_group
from ..core.naming import group_name, register_group_name
from ..safety.liveness import naming_dead_peers

__all__ = ["DP_OUTER_SHARD", "OptimizerSharding", "sub_shard_index"]

DP_OUTER_SHARD = "dp_outer_shard"


def sub_shard_index(shard_rank: int, outer_rank: int, outer_size: int) -> int:
    """The sub-shard of the flat buffer a rank holds under HFSDP."""
    return shard_rank * outer_size + outer_rank


@dataclass(frozen=True)
class OptimizerSharding:
    """The group the optimizer-facing shards partition, and this rank's place in it."""

    group: dist.ProcessGroup
    mesh: DeviceMesh
    """1-D mesh over ``group``: the mesh of the distributed parameters' DTensors."""
    index: int
    """Which of the ``size`` sub-shards of the flat buffer this rank holds."""
    index_of_group_rank: tuple[int, ...]
    """``index_of_group_rank[r]``: the sub-shard held by rank ``r`` of ``group``."""

    @property
    def size(self) -> int:
        return len(self.index_of_group_rank)

    def flattened_mesh(self, outer_mesh: DeviceMesh, shard_mesh: DeviceMesh) -> DeviceMesh:
        """The root mesh's ``(dp_outer, dp_shard)`` flattened into one dim over ``group``'s
        ranks: unlike ``mesh`` (the group's own, which belongs to no root mesh) it joins
        with the root's TP dim. Collective over the root mesh the first time."""
        try:
            joined = concatenate_meshes([outer_mesh, shard_mesh])
        except ValueError as error:
            raise ValueError(
                "HFSDP with TP joins the dp_outer and dp_shard dims of the mesh, which must "
                f"come in that order: {error}"
            ) from error
        flat = flatten_mesh(joined, DP_OUTER_SHARD)
        got = sorted(int(r) for r in flat.mesh.flatten().tolist())
        want = sorted(dist.get_process_group_ranks(self.group))
        if got != want:
            raise ValueError(
                f"the HFSDP group holds ranks {want}, but this rank's flattened (dp_outer, "
                f"dp_shard) submesh is {got}: pass that submesh's group as hybrid_fsdp_group"
            )
        return flat

    def indices_along(self, mesh: DeviceMesh) -> tuple[int, ...]:
        """The sub-shard held at each coordinate of dim 0 of ``mesh`` (a mesh whose dim 0
        spans ``group``'s ranks), this rank's coordinates on its other dims fixed."""
        coordinate = mesh.get_coordinate()
        assert coordinate is not None, "this rank is not in the mesh"
        ranks: torch.Tensor = mesh.mesh
        for position in coordinate[1:]:
            ranks = ranks[:, position]
        group_ranks = dist.get_process_group_ranks(self.group)
        return tuple(self.index_of_group_rank[group_ranks.index(int(r))] for r in ranks.tolist())

    @classmethod
    def across_outer(
        cls,
        group: dist.ProcessGroup,
        *,
        shard_rank: int,
        shard_size: int,
        outer_rank: int,
        outer_size: int,
        device_type: str,
    ) -> OptimizerSharding:
        """HFSDP over ``group``, the ranks of the flattened ``(dp_outer, dp_shard)`` submesh
        (collective: every rank learns each peer's sub-shard; a group that is not one rank
        per ``(outer_rank, shard_rank)`` raises on every rank)."""
        size = dist.get_world_size(group)
        if size != shard_size * outer_size:
            raise ValueError(
                f"the HFSDP group {group_name(group)} has {size} ranks, but dp_outer x "
                f"dp_shard is {outer_size} x {shard_size}: pass the process group of the "
                "flattened (dp_outer, dp_shard) submesh"
            )
        mine = sub_shard_index(shard_rank, outer_rank, outer_size)
        found: list[object] = [None] * size
        if is_fake_group(group):
            # A planning run: the group plan_memory builds is the flattened (dp_outer,
            # dp_shard) mesh, whose rank r is shard rank r % shard_size of replica r // it.
            found = [
                sub_shard_index(r % shard_size, r // shard_size, outer_size) for r in range(size)
            ]
        else:
            with naming_dead_peers("the HFSDP sub-shard exchange", group):
                dist.all_gather_object(found, mine, group=group)
        table = tuple(cast("list[int]", found))
        if sorted(table) != list(range(size)):
            raise ValueError(
                f"the ranks of the HFSDP group {group_name(group)} hold sub-shards {table} "
                "(shard_rank * outer_size + outer_rank): each must appear once. Pass the "
                "group of the flattened (dp_outer, dp_shard) submesh, whose ranks are the "
                "shard groups of every replica"
            )
        # A 1 x N or N x 1 mesh: the group is also the shard or outer group; keep that name.
        register_group_name(group, DP_OUTER_SHARD, replace=False)
        mesh = DeviceMesh.from_group(group, device_type, mesh_dim_names=(DP_OUTER_SHARD,))
        return cls(group=group, mesh=mesh, index=mine, index_of_group_rank=table)
