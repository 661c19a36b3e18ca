"""The data-parallel groups a Megatron-Core model chunk shards over, and the mesh built on them.

Megatron-Core names its groups in a ``ProcessGroupCollection`` (``pg_collection``) or keeps
them in ``megatron.core.parallel_state``; this module finds them in that order and falls back
to the whole world only when nothing else can be meant (no pipeline, tensor, context or expert
parallelism). Under pipeline parallelism the world holds several stages' ranks, so sharding
over it would mix the stages' parameters: that is refused with the fix.

``num_distributed_optimizer_instances > 1`` is Megatron-Core's HSDP: the data-parallel ranks
split into that many instances of consecutive ranks (``intra_dp_cp``), each a full copy of the
model sharded inside it, and the same position across instances forms ``inter_dist_opt``. The
mesh is ``(dp_outer, dp_cp)`` = (instances, ranks in one), built on the existing groups where
Megatron-Core made them (no new group: under PP each stage has its own), after checking that
they have that layout.
"""

from __future__ import annotations

import importlib
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from megatron_fsdp.dist_index import FSDPDistributedIndex

__all__ = ["SHARD_DIM", "OUTER_DIM", "data_parallel_index"]

SHARD_DIM = "dp_cp"
OUTER_DIM = "dp_outer"


def _parallel_state() -> Any | None:
    """Megatron-Core's ``parallel_state`` when it is installed and initialised, else None."""
    try:
        state = importlib.import_module("megatron.core.parallel_state")
    except ImportError:
        return None
    return state if state.model_parallel_is_initialized() else None


def _group(pg_collection: Any, name: str) -> dist.ProcessGroup | None:
    group = getattr(pg_collection, name, None)
    return group if isinstance(group, dist.ProcessGroup) else None


def _model_parallel_sizes(config: Any) -> dict[str, int]:
    names = ("pipeline_model_parallel_size", "tensor_model_parallel_size")
    return {name: int(getattr(config, name, 1) or 1) for name in names}


def _dp_group(config: Any, pg_collection: Any, state: Any | None) -> dist.ProcessGroup:
    if pg_collection is not None:
        group = _group(pg_collection, "dp_cp")
        if group is None:
            raise ValueError(
                "pg_collection: it has no process group 'dp_cp' (Megatron-Core's data x "
                "context parallel group), which FSDP shards over; set pg_collection.dp_cp"
            )
        return group
    if state is not None:
        group = state.get_data_parallel_group(with_context_parallel=True)
        assert isinstance(group, dist.ProcessGroup)
        return group
    parallel = {k: v for k, v in _model_parallel_sizes(config).items() if v > 1}
    if parallel:
        setting = ", ".join(f"config.{k}={v}" for k, v in parallel.items())
        raise ValueError(
            f"{setting}: the data-parallel group is not the whole world, and neither "
            "pg_collection nor megatron.core.parallel_state names it; pass "
            "pg_collection=ProcessGroupCollection.use_mpu_process_groups() (or initialise "
            "parallel_state.initialize_model_parallel before wrapping)"
        )
    world = dist.group.WORLD
    assert world is not None
    return world


def _instance_groups(
    pg_collection: Any, state: Any | None
) -> tuple[dist.ProcessGroup, dist.ProcessGroup] | None:
    """(inter-instance, intra-instance) groups Megatron-Core made, or None."""
    if pg_collection is not None:
        inter, intra = _group(pg_collection, "inter_dist_opt"), _group(pg_collection, "intra_dp_cp")
        if inter is not None and intra is not None:
            return inter, intra
    if state is not None:
        intra = state.get_data_parallel_group(
            with_context_parallel=True, partial_data_parallel=True
        )
        inter = state.get_inter_distributed_optimizer_instance_group()
        return inter, intra
    return None


def _hsdp_mesh(
    dp_group: dist.ProcessGroup, instances: int, made: Any, device_type: str
) -> DeviceMesh:
    ranks = dist.get_process_group_ranks(dp_group)
    if len(ranks) % instances:
        raise ValueError(
            f"ddp_config.num_distributed_optimizer_instances={instances} does not divide the "
            f"{len(ranks)} data-parallel ranks; use a divisor of it"
        )
    grid = torch.tensor(ranks).view(instances, len(ranks) // instances)
    names = (OUTER_DIM, SHARD_DIM)
    if made is None:  # the world is the data-parallel group: every rank builds the mesh
        return init_device_mesh(device_type, tuple(grid.shape), mesh_dim_names=names)
    inter, intra = made
    me = dist.get_rank()
    row, column = (grid == me).nonzero()[0].tolist()
    if (
        dist.get_process_group_ranks(intra) != grid[row].tolist()
        or dist.get_process_group_ranks(inter) != grid[:, column].tolist()
    ):
        raise ValueError(
            "num_distributed_optimizer_instances: the intra- and inter-instance groups are not "
            "Megatron-Core's layout (instances of consecutive data-parallel ranks); megatron-"
            "fsdp shards inside an instance and replicates across them only in that layout"
        )
    return DeviceMesh.from_group([inter, intra], device_type, mesh=grid, mesh_dim_names=names)


def data_parallel_index(
    config: Any, instances: int, outer_sharded: bool, pg_collection: Any, device_type: str
) -> FSDPDistributedIndex:
    """Where a Megatron-Core chunk's FSDP runs: its data x context parallel group (over
    ``instances`` replicas of it with HSDP)."""
    state = _parallel_state()
    dp_group = _dp_group(config, pg_collection, state)
    if instances == 1:
        mesh = DeviceMesh.from_group(dp_group, device_type, mesh_dim_names=(SHARD_DIM,))
        return FSDPDistributedIndex(mesh, dp_shard_dim=SHARD_DIM)
    made = _instance_groups(pg_collection, state)
    if made is None and dp_group is not dist.group.WORLD:
        raise ValueError(
            f"ddp_config.num_distributed_optimizer_instances={instances}: pass pg_collection "
            "with 'intra_dp_cp' and 'inter_dist_opt' (Megatron-Core's partial data-parallel "
            "groups), or initialise megatron.core.parallel_state with "
            "num_distributed_optimizer_instances"
        )
    mesh = _hsdp_mesh(dp_group, instances, made, device_type)
    return FSDPDistributedIndex(
        mesh,
        dp_shard_dim=SHARD_DIM,
        dp_outer_dim=OUTER_DIM,
        hybrid_fsdp_group=dp_group,
        hsdp_outer_dp_shard=outer_sharded,
    )
