"""The ``expt_device_mesh`` argument of ``fully_shard_model``: expert parallelism.

Its ``dp_shard_dim`` (named as on ``device_mesh``) is the expert-data-parallel group, over
which parameters marked ``allreduce=False`` are sharded and reduced. Checked locally.
"""

from __future__ import annotations

from torch.distributed.device_mesh import DeviceMesh

from mfsdp_collectives import FSDPTopology
from mfsdp_hooks import ExpertSharding

__all__ = ["expert_sharding"]


def expert_sharding(
    expt_device_mesh: object, *, dp_shard_dim: str | None, tp_dim: str | None, dense: FSDPTopology
) -> ExpertSharding | None:
    """The expert sharding of ``expt_device_mesh`` (None without one)."""
    if expt_device_mesh is None:
        return None
    if not isinstance(expt_device_mesh, DeviceMesh):
        raise TypeError(
            f"expt_device_mesh must be a DeviceMesh, got {type(expt_device_mesh).__name__}"
        )
    names = tuple(expt_device_mesh.mesh_dim_names or ())
    shard_dim = dp_shard_dim or "dp_shard"
    if shard_dim not in names:
        raise ValueError(
            f"expt_device_mesh has dims {list(names)} but no {shard_dim!r}: name its "
            "expert-data-parallel dim like device_mesh's dp_shard_dim"
        )
    expert_tp = tp_dim if tp_dim is not None and tp_dim in names else None
    topology = FSDPTopology.from_mesh(expt_device_mesh, dp_shard_dim=shard_dim, tp_dim=expert_tp)
    return ExpertSharding(topology=topology, mean_over=dense.shard_size * dense.outer_size)
