"""Hybrid sharding (HSDP, HFSDP) arguments of ``fully_shard_model``, checked before any
collective: every check is local and the same on every rank, so bad input raises on all of
them before anything is communicated.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from mfsdp_collectives import FSDPTopology, mesh_has_dim

__all__ = ["hybrid_topology", "names_hfsdp", "parse_outer_strategy"]

_OUTER_STRATEGIES = {0: "no_shard", "no_shard": "no_shard", 1: "optim", "optim": "optim"}


def names_hfsdp(value: object) -> bool:
    """Whether ``outer_dp_sharding_strategy`` is 1/"optim" (HFSDP) for ``parse_outer_strategy``."""
    return not isinstance(value, bool) and _OUTER_STRATEGIES.get(value) == "optim"


def parse_outer_strategy(value: object, zero_dp_strategy: int) -> str:
    """``outer_dp_sharding_strategy``: 0/"no_shard" is HSDP; 1/"optim" is HFSDP."""
    if isinstance(value, bool) or value not in _OUTER_STRATEGIES:
        raise ValueError(
            f"outer_dp_sharding_strategy={value!r} is not one of 0/'no_shard' (HSDP: replicate "
            "across dp_outer) or 1/'optim' (HFSDP: also shard optimizer state across it)"
        )
    name = _OUTER_STRATEGIES[value]
    if name == "optim" and zero_dp_strategy != 3:
        raise ValueError(
            "outer_dp_sharding_strategy='optim' (HFSDP) needs zero_dp_strategy=3, got "
            f"zero_dp_strategy={zero_dp_strategy}: pass zero_dp_strategy=3 or "
            "outer_dp_sharding_strategy=0"
        )
    return name


def _dp_ranks(mesh: DeviceMesh, dims: tuple[str, str]) -> list[int]:
    """The global ranks of this rank's ``(dp_outer, dp_shard)`` submesh: the ranks its
    flattened group must hold (the shard dim may itself be flattened, e.g. DP x CP)."""
    ranks: torch.Tensor = mesh[dims].mesh
    return sorted(int(r) for r in ranks.flatten().tolist())


def _names_a_dim(mesh: DeviceMesh, dim: str | None) -> bool:
    return dim is not None and mesh_has_dim(mesh, dim)


def hybrid_topology(
    device_mesh: DeviceMesh | None,
    *,
    dp_shard_dim: str | None,
    dp_outer_dim: str | None,
    hybrid_fsdp_group: object,
    outer_strategy: str = "no_shard",
    tp_dim: str | None = None,
) -> FSDPTopology:
    """The HSDP topology of ``device_mesh``, after checking the arguments agree with it;
    with ``outer_strategy="optim"`` (HFSDP) the optimizer-facing shards are cut across
    ``hybrid_fsdp_group`` (one collective over it, after every local check)."""
    if (dp_outer_dim is None) != (hybrid_fsdp_group is None):
        given = "dp_outer_dim" if dp_outer_dim is not None else "hybrid_fsdp_group"
        missing = "hybrid_fsdp_group" if dp_outer_dim is not None else "dp_outer_dim"
        raise ValueError(
            f"{given} was given without {missing}: hybrid sharding needs both, the outer mesh "
            "dim and the process group of the flattened (dp_outer, dp_shard) submesh"
        )
    if not isinstance(device_mesh, DeviceMesh):
        raise ValueError(
            "dp_outer_dim needs device_mesh: pass the mesh that has the dp_outer and dp_shard dims"
        )
    names = tuple(device_mesh.mesh_dim_names or ())
    if not (_names_a_dim(device_mesh, dp_shard_dim) and _names_a_dim(device_mesh, dp_outer_dim)):
        raise ValueError(
            f"dp_shard_dim={dp_shard_dim!r} and dp_outer_dim={dp_outer_dim!r} must both name "
            f"dims of device_mesh, whose mesh_dim_names are {list(names)}"
        )
    if not isinstance(hybrid_fsdp_group, dist.ProcessGroup):
        raise TypeError(
            f"hybrid_fsdp_group must be a ProcessGroup, got {type(hybrid_fsdp_group).__name__}"
        )
    assert dp_outer_dim is not None and dp_shard_dim is not None
    expected = _dp_ranks(device_mesh, (dp_outer_dim, dp_shard_dim))
    got = sorted(dist.get_process_group_ranks(hybrid_fsdp_group))
    if got != expected:
        raise ValueError(
            f"hybrid_fsdp_group holds ranks {got}, but this rank's flattened "
            f"({dp_outer_dim}, {dp_shard_dim}) submesh of device_mesh (dims {list(names)}) is "
            f"{expected}: pass device_mesh[({dp_outer_dim!r}, {dp_shard_dim!r})]._flatten()"
            ".get_group() or a group over exactly those ranks"
        )
    topology = FSDPTopology.from_mesh(
        device_mesh, dp_shard_dim=dp_shard_dim, dp_outer_dim=dp_outer_dim, tp_dim=tp_dim
    )
    if outer_strategy == "optim":
        topology.shard_optimizer_across_outer(hybrid_fsdp_group)
    return topology
