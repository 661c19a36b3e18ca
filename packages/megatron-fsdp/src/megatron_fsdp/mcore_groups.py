"""The data-parallel groups a Megatron-Core model chunk shards over, and the mesh built on them.

Found in ``pg_collection``, else ``megatron.core.parallel_state``, else the whole world only
when nothing else can be meant: under pipeline parallelism the world holds several stages'
ranks, so sharding over it would mix the stages' parameters.

``num_distributed_optimizer_instances > 1`` is Megatron-Core's HSDP: instances of consecutive
data-parallel ranks (``intra_dp_cp``), the same position across them ``inter_dist_opt``. The
mesh ``(dp_outer, dp_cp)`` is built on Megatron-Core's own groups (no new group: under PP each
stage has its own), after checking that they form that grid.
"""

from __future__ import annotations

import importlib
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from megatron_fsdp.dist_index import FSDPDistributedIndex

__all__ = ["OUTER_DIM", "SHARD_DIM", "TP_DIM", "data_parallel_index"]

SHARD_DIM = "dp_cp"
OUTER_DIM = "dp_outer"
TP_DIM = "tp"


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


def _others(coords: tuple[int, ...], dim: int) -> tuple[int, ...]:
    return coords[:dim] + coords[dim + 1 :]


def _mesh_from_groups(
    dims: list[tuple[str, dist.ProcessGroup]], span: dist.ProcessGroup, device_type: str
) -> DeviceMesh:
    """The mesh whose dims are the given groups (each the one holding this rank), built on
    those groups (no new one): every rank of ``span`` (the ranks of the whole mesh) tells its
    coordinates, and each group must be the line of the grid through its ranks."""
    coords = tuple(dist.get_rank(group) for _, group in dims)
    told: list[Any] = [None] * span.size()
    dist.all_gather_object(told, (coords, dist.get_rank()), group=span)
    shape = tuple(group.size() for _, group in dims)
    grid = torch.full(shape, -1, dtype=torch.long)
    for where, rank in told:
        grid[where] = rank
    names = tuple(name for name, _ in dims)
    # The line through this rank along dim i: its coordinates with dim i left free.
    lines_agree = all(
        dist.get_process_group_ranks(group) == grid.movedim(i, -1)[_others(coords, i)].tolist()
        for i, (_, group) in enumerate(dims)
    )
    if grid.numel() != span.size() or (grid < 0).any() or not lines_agree:
        raise ValueError(
            f"the process groups for the mesh dims {list(names)} do not form a grid over "
            f"the {span.size()} ranks that hold them (Megatron-Core's layout is expected): "
            "pass Megatron-Core's own groups (ProcessGroupCollection.use_mpu_process_groups())"
        )
    return DeviceMesh.from_group([g for _, g in dims], device_type, mesh=grid, mesh_dim_names=names)


def _tensor_groups(
    config: Any, pg_collection: Any, state: Any | None
) -> tuple[dist.ProcessGroup, dist.ProcessGroup] | None:
    """(TP group, the TP x DP x CP group that spans the mesh), or None without TP."""
    size = int(getattr(config, "tensor_model_parallel_size", 1) or 1)
    if pg_collection is not None:
        tp, span = _group(pg_collection, "tp"), _group(pg_collection, "tp_dp_cp")
    elif state is not None:
        tp = state.get_tensor_model_parallel_group()
        span = state.get_tensor_and_data_parallel_group(with_context_parallel=True)
    else:
        tp = span = None
    given = tp.size() if tp is not None else 1
    if given != size:
        raise ValueError(
            f"config.tensor_model_parallel_size={size} but the tensor-parallel group has "
            f"{given} rank(s): build the config and the groups with the same TP size"
        )
    if size == 1:
        return None
    if span is None:
        raise ValueError(
            f"config.tensor_model_parallel_size={size}: pg_collection has no 'tp_dp_cp' (the "
            "tensor x data x context parallel group the FSDP x TP mesh spans); pass "
            "ProcessGroupCollection.use_mpu_process_groups()"
        )
    assert tp is not None
    return tp, span


def _expert_mesh(
    config: Any, pg_collection: Any, state: Any | None, dp_group: dist.ProcessGroup, device: str
) -> DeviceMesh | None:
    """The expert-data-parallel mesh of a MoE model (its experts, marked ``allreduce=False``,
    shard over the ranks that hold the same experts), or None without experts."""
    if not getattr(config, "num_moe_experts", None):
        return None
    ep = int(getattr(config, "expert_model_parallel_size", 1) or 1)
    expert_tp = int(getattr(config, "expert_tensor_parallel_size", None) or 1)
    if expert_tp > 1:
        raise NotImplementedError(
            f"config.expert_tensor_parallel_size={expert_tp}: tensor-parallel experts through "
            "the Megatron-Core adapter are not supported yet; set it to 1"
        )
    if pg_collection is not None:
        group = _group(pg_collection, "expt_dp")
    elif state is not None:
        group = state.get_expert_data_parallel_group()
    else:
        group = dp_group if ep == 1 else None
    if group is None:
        raise ValueError(
            f"config.num_moe_experts with expert_model_parallel_size={ep}: pass pg_collection "
            "with 'expt_dp' (Megatron-Core's expert-data-parallel group), or initialise "
            "megatron.core.parallel_state with expert_model_parallel_size"
        )
    return DeviceMesh.from_group(group, device, mesh_dim_names=(SHARD_DIM,))


def data_parallel_index(
    config: Any, instances: int, outer_sharded: bool, pg_collection: Any, device_type: str
) -> FSDPDistributedIndex:
    """Where a Megatron-Core chunk's FSDP runs: its data x context parallel group (over
    ``instances`` replicas of it with HSDP), beside its tensor-parallel group."""
    state = _parallel_state()
    dp_group = _dp_group(config, pg_collection, state)
    tensor = _tensor_groups(config, pg_collection, state)
    if dp_group.size() % instances:
        raise ValueError(
            f"ddp_config.num_distributed_optimizer_instances={instances} does not divide the "
            f"{dp_group.size()} data-parallel ranks; use a divisor of it"
        )
    hsdp = instances > 1
    dims = [(SHARD_DIM, dp_group)]
    if hsdp:
        made = _instance_groups(pg_collection, state)
        if made is None and dp_group is dist.group.WORLD and tensor is None:
            # Every rank is a data-parallel rank: Megatron-Core's layout, built here.
            shape = (instances, dp_group.size() // instances)
            mesh = init_device_mesh(device_type, shape, mesh_dim_names=(OUTER_DIM, SHARD_DIM))
            return _index(mesh, dp_group, hsdp, False, outer_sharded, None)
        if made is None:
            raise ValueError(
                f"ddp_config.num_distributed_optimizer_instances={instances}: pass "
                "pg_collection with 'intra_dp_cp' and 'inter_dist_opt' (Megatron-Core's "
                "partial data-parallel groups), or initialise megatron.core.parallel_state "
                "with num_distributed_optimizer_instances"
            )
        dims = [(OUTER_DIM, made[0]), (SHARD_DIM, made[1])]
    if tensor is not None:
        dims.append((TP_DIM, tensor[0]))
    if len(dims) == 1:
        mesh = DeviceMesh.from_group(dp_group, device_type, mesh_dim_names=(SHARD_DIM,))
    else:
        mesh = _mesh_from_groups(dims, tensor[1] if tensor else dp_group, device_type)
    experts = _expert_mesh(config, pg_collection, state, dp_group, device_type)
    return _index(mesh, dp_group, hsdp, tensor is not None, outer_sharded, experts)


def _index(
    mesh: DeviceMesh,
    dp_group: dist.ProcessGroup,
    hsdp: bool,
    tp: bool,
    outer_sharded: bool,
    experts: DeviceMesh | None,
) -> FSDPDistributedIndex:
    return FSDPDistributedIndex(
        mesh,
        dp_shard_dim=SHARD_DIM,
        dp_outer_dim=OUTER_DIM if hsdp else None,
        tp_dim=TP_DIM if tp else None,
        hybrid_fsdp_group=dp_group if hsdp else None,
        hsdp_outer_dp_shard=outer_sharded,
        expt_device_mesh=experts,
    )
