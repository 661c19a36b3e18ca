"""``fully_shard_model``'s arguments, checked and turned into the engine's one options record.

Both entry points come here: ``fully_shard_model`` and the reference's class constructor
(``reference_options`` reads its index and config into the same arguments).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy

from megatron_fsdp.expert_mesh import expert_sharding
from megatron_fsdp.hybrid import hybrid_topology, parse_outer_strategy
from megatron_fsdp.unsupported import refuse_unsupported
from mfsdp_buffers import OnFull
from mfsdp_collectives import FSDPTopology, check_post_forward_size
from mfsdp_hooks import (
    DoubleBuffer,
    MixedPrecisionPolicy,
    ShardingOptions,
    ShardingStrategy,
    UnitSpec,
    check_post_forward_strategy,
    parse_strategy,
    resolve_topology,
    resolve_unit_modules,
)
from mfsdp_te import float8_codecs

__all__ = ["grad_buffer_choice", "sharding_options"]


def _topology(
    module: nn.Module,
    device_mesh: DeviceMesh | None,
    dp_shard_dim: str | None,
    device: torch.device | str | None,
    tp_dim: str | None,
) -> FSDPTopology:
    if device_mesh is None:
        if tp_dim is not None:
            raise ValueError(
                f"tp_dim={tp_dim!r} was given without device_mesh: pass the mesh that has "
                "the dp_shard and tp dims"
            )
        if dp_shard_dim is not None:
            raise ValueError(
                f"dp_shard_dim={dp_shard_dim!r} was given without device_mesh: pass the mesh "
                "that has this dim, or drop dp_shard_dim to let megatron-fsdp build a 1-D mesh"
            )
        return resolve_topology(None, module, device)
    if not isinstance(device_mesh, DeviceMesh):
        raise TypeError(f"device_mesh must be a DeviceMesh, got {type(device_mesh).__name__}")
    if dp_shard_dim is None:
        if device_mesh.ndim != 1:
            raise ValueError(
                f"dp_shard_dim is required with a {device_mesh.ndim}-D device_mesh "
                f"{device_mesh.mesh_dim_names or ()}: name the sub-mesh FSDP shards over "
                "(e.g. dp_shard_dim='dp_shard_cp')"
            )
        if tp_dim is None:  # a 1-D mesh: the engine's own reading of it
            return resolve_topology(device_mesh, module)
        dp_shard_dim = (device_mesh.mesh_dim_names or ("dp_shard",))[0]
    return FSDPTopology.from_mesh(device_mesh, dp_shard_dim=dp_shard_dim, tp_dim=tp_dim)


def _offload_policy(optimizer_cpu_offload: object) -> CPUOffloadPolicy | None:
    """``optimizer_cpu_offload`` as the engine's record takes it: FSDP2's policy, pinned."""
    if not isinstance(optimizer_cpu_offload, bool):
        raise TypeError(
            f"optimizer_cpu_offload must be a bool, got {type(optimizer_cpu_offload).__name__}"
        )
    return CPUOffloadPolicy(pin_memory=True) if optimizer_cpu_offload else None


def _check_units_for(strategy: ShardingStrategy, units: Sequence[UnitSpec] | None) -> None:
    if not units and strategy != ShardingStrategy.NO_SHARD:
        # The seed README: required for strategies 1-3. Without units the whole model
        # would be one unit, every weight gathered at once.
        raise ValueError(
            f"fsdp_unit_modules is required with zero_dp_strategy={int(strategy)} "
            f"({strategy.name.lower()}): pass the class of the model's repeated blocks, "
            "e.g. fsdp_unit_modules=[TransformerBlock] (or [type(model)] for one "
            "whole-model unit), or use zero_dp_strategy=0 to replicate like DDP"
        )


def _policy(
    given: MixedPrecisionPolicy | None,
    grad_reduce_in_fp32: bool,
    preserve_fp32_weights: bool,
    use_decoupled_grad: bool,
) -> MixedPrecisionPolicy:
    if given is None:
        given = MixedPrecisionPolicy(
            reduce_dtype=torch.float32 if grad_reduce_in_fp32 else None,
            main_params_dtype=torch.float32 if preserve_fp32_weights else None,
        )
    elif not isinstance(given, MixedPrecisionPolicy):
        raise TypeError(
            "mixed_precision_policy must be a megatron_fsdp.MixedPrecisionPolicy, "
            f"got {type(given).__name__}"
        )
    elif grad_reduce_in_fp32 or not preserve_fp32_weights:
        raise ValueError(
            "mixed_precision_policy was given together with grad_reduce_in_fp32/"
            "preserve_fp32_weights: set reduce_dtype/main_params_dtype in the policy instead"
        )
    return dataclasses.replace(given, use_decoupled_grad=True) if use_decoupled_grad else given


def grad_buffer_choice(
    fsdp_double_buffer: bool, fsdp_db_use_persist_buf_on_alloc_fail: bool, *, max_pool: bool
) -> str | DoubleBuffer:
    """The reduce buffers' allocator for the reference's double-buffer options.

    Persistent double buffers serve the reduce-scatter inputs (gathered weights keep one
    storage per unit whose bytes are freed after use: autograd holds views of it). A request
    no slot can serve is allocated afresh, as the reference's dynamic allocator does, or
    (``fsdp_db_use_persist_buf_on_alloc_fail``) from a buffer kept for that unit."""
    if not fsdp_double_buffer:
        for name, value in (
            ("fsdp_db_use_persist_buf_on_alloc_fail", fsdp_db_use_persist_buf_on_alloc_fail),
            ("megatron_fsdp_max_pool_double_buffer", max_pool),
        ):
            if value:
                raise ValueError(
                    f"{name}=True shapes the double buffer, which is off: set "
                    "fsdp_double_buffer=True too (or leave it False)"
                )
        return "plain"
    on_full: OnFull = "persistent" if fsdp_db_use_persist_buf_on_alloc_fail else "dynamic"
    return DoubleBuffer(max_pool=max_pool, on_full=on_full)


@dataclasses.dataclass(frozen=True)
class _MeshArguments:
    device_mesh: DeviceMesh | None
    dp_shard_dim: str | None
    dp_outer_dim: str | None
    tp_dim: str | None
    hybrid_fsdp_group: dist.ProcessGroup | None


def _resolve_topology(
    module: nn.Module,
    mesh: _MeshArguments,
    outer_strategy: str,
    device: torch.device | str | None,
) -> FSDPTopology:
    """The topology the mesh arguments name: one DP dim, or HSDP/HFSDP over two."""
    if mesh.dp_outer_dim is None and mesh.hybrid_fsdp_group is None:
        if outer_strategy == "optim":
            raise ValueError(
                "outer_dp_sharding_strategy='optim' (HFSDP) shards across dp_outer: pass "
                "device_mesh, dp_outer_dim and hybrid_fsdp_group too"
            )
        return _topology(module, mesh.device_mesh, mesh.dp_shard_dim, device, mesh.tp_dim)
    return hybrid_topology(
        mesh.device_mesh,
        dp_shard_dim=mesh.dp_shard_dim,
        dp_outer_dim=mesh.dp_outer_dim,
        hybrid_fsdp_group=mesh.hybrid_fsdp_group,
        outer_strategy=outer_strategy,
        tp_dim=mesh.tp_dim,
    )


def _check_group_size(size: int | None, strategy: ShardingStrategy, shard_size: int) -> None:
    """``reshard_after_forward_group_size``: a divisor of the shard group's size, ZeRO-3 only
    (the other strategies keep the weights unsharded anyway)."""
    if size is None:
        return
    check_post_forward_size(size, shard_size, "reshard_after_forward_group_size")
    option = f"reshard_after_forward_group_size={size}"
    check_post_forward_strategy(option, strategy, "zero_dp_strategy", "leave it None")


def sharding_options(
    module: nn.Module,
    fsdp_unit_modules: Sequence[UnitSpec] | None = None,
    *,
    device_mesh: DeviceMesh | None = None,
    dp_shard_dim: str | None = None,
    dp_outer_dim: str | None = None,
    tp_dim: str | None = None,
    hybrid_fsdp_group: dist.ProcessGroup | None = None,
    expt_device_mesh: DeviceMesh | None = None,
    device: torch.device | str | None = None,
    mixed_precision_policy: MixedPrecisionPolicy | None = None,
    zero_dp_strategy: int | str = 3,
    outer_dp_sharding_strategy: int | str = 0,
    init_model_with_meta_device: bool = False,
    grad_reduce_in_fp32: bool = False,
    preserve_fp32_weights: bool = True,
    overlap_grad_reduce: bool = True,
    overlap_param_gather: bool = True,
    sync_model_each_microbatch: bool = True,
    average_in_collective: bool = True,
    gradient_scaling_factor: float | None = None,
    calculate_per_token_loss: bool = False,
    report_nan_in_param_grad: bool = False,
    enable_fine_grained_param_gather: bool = False,
    keep_fp8_transpose_cache: bool = False,
    nccl_ub: bool = False,
    fsdp_manual_registration: bool = False,
    disable_symmetric_registration: bool = False,
    fsdp_double_buffer: bool = False,
    fsdp_db_use_persist_buf_on_alloc_fail: bool = False,
    use_decoupled_grad: bool = False,
    host_transport: str = "auto",
    backward_prefetch_grad_fraction: float = 0.5,
    reshard_after_forward_group_size: int | None = None,
    check_replicas: bool = True,
    optimizer_cpu_offload: bool = False,
) -> ShardingOptions:
    """Check ``fully_shard_model``'s arguments (locally, then the topology's collectives),
    move ``module`` to ``device`` when asked, and return the engine's options record.

    The one list of ``fully_shard_model``'s arguments, which it and ``fully_shard`` repeat
    so ``help()``, IDEs and mypy see each (``tests/test_megatron_fsdp_signatures.py`` keeps
    the three in step)."""
    refuse_unsupported(
        "argument",
        {
            "nccl_ub": nccl_ub,
            "fsdp_manual_registration": fsdp_manual_registration,
            "disable_symmetric_registration": disable_symmetric_registration,
            "keep_fp8_transpose_cache": keep_fp8_transpose_cache,
        },
    )
    if not isinstance(module, nn.Module):
        raise TypeError(f"module must be an nn.Module, got {type(module).__name__}")
    resolve_unit_modules(fsdp_unit_modules)
    offload_policy = _offload_policy(optimizer_cpu_offload)
    strategy = parse_strategy(zero_dp_strategy, "zero_dp_strategy")
    _check_units_for(strategy, fsdp_unit_modules)
    policy = _policy(
        mixed_precision_policy, grad_reduce_in_fp32, preserve_fp32_weights, use_decoupled_grad
    )
    if device is not None and not init_model_with_meta_device:
        module.to(device)  # in place: an nn.Module's .to() returns the module itself
    outer_strategy = parse_outer_strategy(outer_dp_sharding_strategy, int(strategy))
    mesh = _MeshArguments(device_mesh, dp_shard_dim, dp_outer_dim, tp_dim, hybrid_fsdp_group)
    topology = _resolve_topology(module, mesh, outer_strategy, device)
    experts = expert_sharding(
        expt_device_mesh, dp_shard_dim=dp_shard_dim, tp_dim=tp_dim, dense=topology
    )
    _check_group_size(reshard_after_forward_group_size, strategy, topology.shard_size)
    return ShardingOptions(
        zero_dp_strategy=strategy,
        device_mesh=topology,
        mixed_precision_policy=policy,
        init_model_with_meta_device=init_model_with_meta_device,
        overlap_grad_reduce=overlap_grad_reduce,
        overlap_param_gather=overlap_param_gather,
        sync_model_each_microbatch=sync_model_each_microbatch,
        average_in_collective=average_in_collective,
        gradient_scaling_factor=gradient_scaling_factor,
        calculate_per_token_loss=calculate_per_token_loss,
        report_nan_in_param_grad=report_nan_in_param_grad,
        host_transport=host_transport,
        backward_prefetch_grad_fraction=backward_prefetch_grad_fraction,
        grad_buffer_allocator=grad_buffer_choice(
            fsdp_double_buffer, fsdp_db_use_persist_buf_on_alloc_fail, max_pool=False
        ),
        experts=experts,
        fine_grained_param_gather=enable_fine_grained_param_gather,
        reshard_after_forward=reshard_after_forward_group_size,
        reduce_scatter_in_no_sync=True,  # Megatron-FSDP's no_sync: ZeRO-2/3 still reduce-scatter
        param_codecs=float8_codecs(),  # torchao float8 weights travel as float8 bytes
        check_replicas=check_replicas,
        offload_policy=offload_policy,
    )
