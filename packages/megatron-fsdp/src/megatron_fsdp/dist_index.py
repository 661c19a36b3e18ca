"""The reference's ``FSDPDistributedIndex``: which mesh dims and groups FSDP runs over.

The groups are looked up from the mesh as the reference does; ``reference_options`` hands the
same arguments to ``fully_shard_model``, which checks them against each other.
"""

from __future__ import annotations

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from megatron_fsdp.unsupported import refuse_unsupported
from mfsdp_collectives import mesh_has_dim

__all__ = ["FSDPDistributedIndex"]


def _group_of(mesh: DeviceMesh | None, dim: str | None) -> dist.ProcessGroup | None:
    if mesh is None or dim is None or not mesh_has_dim(mesh, dim):
        return None
    return mesh[dim].get_group()


class FSDPDistributedIndex:
    """Mesh dims and process groups of one sharded model, as the reference names them."""

    def __init__(
        self,
        device_mesh: DeviceMesh,
        dp_shard_dim: str | None = None,
        dp_outer_dim: str | None = None,
        tp_dim: str | None = None,
        hybrid_fsdp_group: dist.ProcessGroup | None = None,
        hybrid_fsdp_expt_group: dist.ProcessGroup | None = None,
        hsdp_outer_dp_shard: bool = False,
        expt_device_mesh: DeviceMesh | None = None,
        fsdp_group_ag: dist.ProcessGroup | None = None,
        expt_fsdp_group_ag: dist.ProcessGroup | None = None,
    ) -> None:
        if not isinstance(device_mesh, DeviceMesh):
            raise TypeError(f"device_mesh must be a DeviceMesh, got {type(device_mesh).__name__}")
        refuse_unsupported(
            "dist_index",
            {
                "hybrid_fsdp_expt_group": hybrid_fsdp_expt_group,
                "fsdp_group_ag": fsdp_group_ag,
                "expt_fsdp_group_ag": expt_fsdp_group_ag,
            },
        )
        self.device_mesh = device_mesh
        self.dp_shard_dim = dp_shard_dim
        self.dp_outer_dim = dp_outer_dim
        self.tp_dim = tp_dim
        self.use_hybrid_fsdp = dp_outer_dim is not None
        self.hsdp_outer_dp_shard = hsdp_outer_dp_shard
        self.expt_device_mesh = expt_device_mesh
        self.hybrid_fsdp_group = hybrid_fsdp_group
        self.fsdp_group = _group_of(device_mesh, dp_shard_dim)
        self.outer_fsdp_group = _group_of(device_mesh, dp_outer_dim)
        self.expt_fsdp_group = _group_of(expt_device_mesh, dp_shard_dim)
        if self.fsdp_group is None:
            raise ValueError(
                f"dp_shard_dim={dp_shard_dim!r} names no dim of device_mesh (dims "
                f"{list(device_mesh.mesh_dim_names or ())}): name the dim FSDP shards over"
            )
        if self.use_hybrid_fsdp and (self.outer_fsdp_group is None or hybrid_fsdp_group is None):
            raise ValueError(
                f"dp_outer_dim={dp_outer_dim!r}: hybrid FSDP needs a dim of device_mesh by that "
                "name and hybrid_fsdp_group (the flattened (dp_outer, dp_shard) group)"
            )

    def get_dp_group(self, is_expert_parallel: bool = False) -> dist.ProcessGroup | None:
        """Every data-parallel rank: the hybrid group under HSDP, else the shard group."""
        if self.use_hybrid_fsdp and not is_expert_parallel:
            return self.hybrid_fsdp_group
        return self.expt_fsdp_group if is_expert_parallel else self.fsdp_group

    def get_fsdp_group(
        self, is_expert_parallel: bool = False, independent_all_gather: bool = False
    ) -> dist.ProcessGroup | None:
        del independent_all_gather  # no separate all-gather groups (refused at construction)
        return self.expt_fsdp_group if is_expert_parallel else self.fsdp_group

    def get_outer_fsdp_group(self, is_expert_parallel: bool = False) -> dist.ProcessGroup | None:
        return None if is_expert_parallel or not self.use_hybrid_fsdp else self.outer_fsdp_group

    def get_root_mesh(self, is_expert_parallel: bool = False) -> DeviceMesh | None:
        return self.expt_device_mesh if is_expert_parallel else self.device_mesh
