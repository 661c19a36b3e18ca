"""The parity matrix's meshes per column, and each rank's share of a batch."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from matrix_columns import family
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from mfsdp_collectives import FSDPTopology
from mfsdp_hooks import ExpertSharding


@dataclass
class Layout:
    """A column's meshes and this rank's share of the data."""

    device_mesh: DeviceMesh | None = None
    dp_shard_dim: str | None = None
    dp_outer_dim: str | None = None
    tp_dim: str | None = None
    hybrid_group: dist.ProcessGroup | None = None
    outer_optim: bool = False
    expert_mesh: DeviceMesh | None = None
    per_module_mesh: DeviceMesh | FSDPTopology | None = None
    experts: ExpertSharding | None = None
    dp: tuple[int, int] = (0, 1)  # (rank, size) over the batch rows
    cp: tuple[int, int] = (0, 1)  # (rank, size) over the sequence
    tp_mesh: DeviceMesh | None = None


def make_layout(col: str, rank: int, world: int) -> Layout:
    if col in ("hsdp", "hfsdp"):
        mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("dp_outer", "dp_shard"))
        per_module: DeviceMesh | FSDPTopology = mesh  # FSDP2's (replicate, shard) convention
        if col == "hfsdp":
            topology = FSDPTopology.from_mesh(
                mesh, dp_shard_dim="dp_shard", dp_outer_dim="dp_outer"
            )
            topology.shard_optimizer_across_outer(dist.group.WORLD)  # type: ignore[arg-type]
            per_module = topology
        return Layout(
            device_mesh=mesh,
            dp_shard_dim="dp_shard",
            dp_outer_dim="dp_outer",
            hybrid_group=dist.group.WORLD,
            outer_optim=col == "hfsdp",
            per_module_mesh=per_module,
            dp=(rank, world),
        )
    if col == "hfsdp_tp":
        return _hfsdp_tp_layout(world)
    if family(col) == "tp":
        mesh = init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("dp_shard", "tp"))
        per_module = mesh["dp_shard"]  # DTensor TP: FSDP2's way, the 1-D DP mesh
        if col == "tp_megatron":  # plain local TP tensors: the engine needs the TP dim named
            per_module = FSDPTopology.from_mesh(mesh, dp_shard_dim="dp_shard", tp_dim="tp")
        return Layout(
            device_mesh=mesh,
            dp_shard_dim="dp_shard",
            tp_dim="tp",
            per_module_mesh=per_module,
            dp=(mesh["dp_shard"].get_local_rank(), world // 2),
            tp_mesh=mesh["tp"],
        )
    if family(col) == "ep":
        dense = init_device_mesh("cpu", (world,), mesh_dim_names=("dp_shard",))
        expert = init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("dp_shard", "ep"))
        experts = ExpertSharding(
            topology=FSDPTopology.from_mesh(expert, dp_shard_dim="dp_shard"), mean_over=world
        )
        return Layout(
            device_mesh=dense,
            dp_shard_dim="dp_shard",
            expert_mesh=expert,
            per_module_mesh=dense,
            experts=experts,
            dp=(rank, world),
        )
    if col == "cp":
        mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("dp_shard", "cp"))
        flat = mesh["dp_shard", "cp"]._flatten("dp_shard_cp")
        return Layout(
            device_mesh=mesh,
            dp_shard_dim="dp_shard_cp",
            per_module_mesh=flat,
            dp=(mesh["dp_shard"].get_local_rank(), 2),
            cp=(mesh["cp"].get_local_rank(), world // 2),
        )
    return Layout(dp=(rank, world))


def _hfsdp_tp_layout(world: int) -> Layout:
    """(dp_outer=2, dp_shard, tp=2) with the optimizer sharded across dp_outer as well."""
    dims = ("dp_outer", "dp_shard", "tp")
    mesh = init_device_mesh("cpu", (2, world // 4, 2), mesh_dim_names=dims)
    dp_mesh = mesh["dp_outer", "dp_shard"]._flatten("dp")
    topology = FSDPTopology.from_mesh(
        mesh, dp_shard_dim="dp_shard", dp_outer_dim="dp_outer", tp_dim="tp"
    )
    topology.shard_optimizer_across_outer(dp_mesh.get_group())
    return Layout(
        device_mesh=mesh,
        dp_shard_dim="dp_shard",
        dp_outer_dim="dp_outer",
        tp_dim="tp",
        hybrid_group=dp_mesh.get_group(),
        outer_optim=True,
        per_module_mesh=topology,
        dp=(dp_mesh.get_local_rank(), dp_mesh.size()),
        tp_mesh=mesh["tp"],
    )


def local_share(
    x: torch.Tensor, y: torch.Tensor, layout: Layout
) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's rows (and, under cp, its part of the sequence) of a batch."""
    (dp_rank, dp_size), (cp_rank, cp_size) = layout.dp, layout.cp
    x, y = x.chunk(dp_size)[dp_rank], y.chunk(dp_size)[dp_rank]
    if cp_size > 1:
        x, y = x.chunk(cp_size, dim=1)[cp_rank], y.chunk(cp_size, dim=1)[cp_rank]
    return x, y
