"""The one place a user's mesh becomes an ``FSDPTopology``: ``fully_shard(mesh=...)``, the
root wrapper's ``ShardingOptions.device_mesh`` and ``megatron_fsdp``'s ``device_mesh`` without
explicit dims all resolve through ``resolve_topology``."""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from mfsdp_collectives import FSDPTopology

__all__ = ["resolve_topology"]


def _named(mesh: DeviceMesh) -> DeviceMesh:
    """FSDP2's canonical ``init_device_mesh("cpu", (world,))`` has no dim names: the same
    group, named (no collective). A 2-D mesh needs names, as FSDP2 requires for HSDP."""
    if mesh.mesh_dim_names:
        return mesh
    if mesh.ndim != 1:
        raise ValueError(
            "mesh: a 2-D mesh (HSDP) needs dim names: init_device_mesh(..., "
            "mesh_dim_names=('dp_outer', 'dp_shard'))"
        )
    return DeviceMesh.from_group(mesh.get_group(), mesh.device_type, mesh_dim_names=("dp_shard",))


def resolve_topology(
    mesh: DeviceMesh | FSDPTopology | None,
    module: nn.Module,
    device: torch.device | str | None = None,
) -> FSDPTopology:
    """The topology ``fully_shard(module, mesh=mesh)`` uses (may communicate: new groups).
    Without a mesh: the whole world on ``device``, or else on the device of ``module``'s
    first materialised parameter."""
    if isinstance(mesh, FSDPTopology):
        return mesh
    if mesh is None:
        if device is None:
            device = next((p.device for p in module.parameters() if p.device.type != "meta"), None)
        return FSDPTopology.default(device)
    if isinstance(mesh, DeviceMesh):
        if mesh.ndim > 2:
            raise NotImplementedError(
                f"mesh has {mesh.ndim} dims {mesh.mesh_dim_names}: fully_shard takes a 1-D mesh "
                "(FSDP) or a 2-D (replicate, shard) mesh (HSDP); pass mesh[('dp_outer', "
                "'dp_shard')] or mesh['dp_shard']"
            )
        mesh = _named(mesh)
        names = mesh.mesh_dim_names or ()
        if mesh.ndim == 2:  # FSDP2's convention: (replicate, shard) means HSDP
            return FSDPTopology.from_mesh(mesh, dp_shard_dim=names[1], dp_outer_dim=names[0])
        return FSDPTopology.from_mesh(mesh, dp_shard_dim=names[0])
    raise TypeError(f"mesh must be a DeviceMesh or None, got {type(mesh).__name__}")
