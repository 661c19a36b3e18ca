"""``fully_shard_model``'s arguments, checked and turned into the engine's options.

One place for both entry points: ``fully_shard_model(module, ...)`` and the reference's class
constructor ``MegatronFSDP(module, dist_index, ddp_config, ...)`` (``wrapper.py``), which
maps its index and config onto the same arguments.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from megatron_fsdp.expert_mesh import expert_sharding
from megatron_fsdp.hybrid import hybrid_topology, parse_outer_strategy
from mfsdp_collectives import FSDPTopology
from mfsdp_hooks import MixedPrecisionPolicy, UnitSpec, parse_strategy, resolve_unit_modules
from mfsdp_te import float8_codecs

__all__ = ["engine_kwargs"]


# argument -> (default, why it is not available yet)
_NOT_YET: dict[str, tuple[Any, str]] = {
    "nccl_ub": (False, "NCCL user buffers"),
    "fsdp_manual_registration": (False, "NCCL user-buffer manual registration"),
    "disable_symmetric_registration": (False, "NCCL user-buffer symmetric registration"),
    "keep_fp8_transpose_cache": (False, "FP8 parameters"),
    "enable_fine_grained_param_gather": (False, "per-module fine-grained all-gather"),
}


def _reject_not_yet(options: dict[str, Any]) -> None:
    for name, value in options.items():
        default, feature = _NOT_YET[name]
        if value != default and not (default is None and value is None):
            raise NotImplementedError(
                f"{name}={value!r}: {feature} is not supported yet by megatron-fsdp; "
                f"leave {name} at its default ({default!r})"
            )


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
        if device is None:
            device = next((p.device for p in module.parameters() if not p.is_meta), None)
        return FSDPTopology.default(device)
    if not isinstance(device_mesh, DeviceMesh):
        raise TypeError(f"device_mesh must be a DeviceMesh, got {type(device_mesh).__name__}")
    if dp_shard_dim is None:
        names = device_mesh.mesh_dim_names or ()
        if device_mesh.ndim != 1:
            raise ValueError(
                f"dp_shard_dim is required with a {device_mesh.ndim}-D device_mesh {names}: "
                "name the sub-mesh FSDP shards over (e.g. dp_shard_dim='dp_shard_cp')"
            )
        dp_shard_dim = names[0] if names else "dp_shard"
    return FSDPTopology.from_mesh(device_mesh, dp_shard_dim=dp_shard_dim, tp_dim=tp_dim)


def _check_module_and_units(module: object, fsdp_unit_modules: Sequence[UnitSpec] | None) -> None:
    if not isinstance(module, nn.Module):
        raise TypeError(f"module must be an nn.Module, got {type(module).__name__}")
    resolve_unit_modules(fsdp_unit_modules)


def _policy(
    given: MixedPrecisionPolicy | None, grad_reduce_in_fp32: bool, preserve_fp32_weights: bool
) -> MixedPrecisionPolicy:
    if given is not None:
        if not isinstance(given, MixedPrecisionPolicy):
            raise TypeError(
                "mixed_precision_policy must be a megatron_fsdp.MixedPrecisionPolicy, "
                f"got {type(given).__name__}"
            )
        if grad_reduce_in_fp32 or not preserve_fp32_weights:
            raise ValueError(
                "mixed_precision_policy was given together with grad_reduce_in_fp32/"
                "preserve_fp32_weights: set reduce_dtype/main_params_dtype in the policy instead"
            )
        return given
    return MixedPrecisionPolicy(
        reduce_dtype=torch.float32 if grad_reduce_in_fp32 else None,
        main_params_dtype=torch.float32 if preserve_fp32_weights else None,
    )


def engine_kwargs(
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
    host_transport: str = "auto",
    backward_prefetch_grad_fraction: float = 0.5,
) -> dict[str, Any]:
    """Check ``fully_shard_model``'s arguments (locally, then the topology's collectives) and
    return the engine's: ``mfsdp_hooks.MegatronFSDP`` keyword arguments (``module``, moved
    to ``device`` when asked, included).

    This signature is the one list of ``fully_shard_model``'s arguments: ``fully_shard_model``
    and ``fully_shard`` repeat it explicitly (so ``help()``, IDEs and mypy see every argument;
    ``megatron_fsdp.api`` documents each) and ``tests/test_megatron_fsdp_signatures.py`` keeps
    the three in step: the same names, order, annotations and defaults."""
    _reject_not_yet(
        {
            "nccl_ub": nccl_ub,
            "fsdp_manual_registration": fsdp_manual_registration,
            "disable_symmetric_registration": disable_symmetric_registration,
            "keep_fp8_transpose_cache": keep_fp8_transpose_cache,
            "enable_fine_grained_param_gather": enable_fine_grained_param_gather,
        }
    )
    _check_module_and_units(module, fsdp_unit_modules)
    strategy = parse_strategy(zero_dp_strategy, "zero_dp_strategy")
    policy = _policy(mixed_precision_policy, grad_reduce_in_fp32, preserve_fp32_weights)
    if device is not None and not init_model_with_meta_device:
        module = module.to(device)
    outer_strategy = parse_outer_strategy(outer_dp_sharding_strategy, int(strategy))
    if dp_outer_dim is None and hybrid_fsdp_group is None:
        if outer_strategy == "optim":
            raise ValueError(
                "outer_dp_sharding_strategy='optim' (HFSDP) shards across dp_outer: pass "
                "device_mesh, dp_outer_dim and hybrid_fsdp_group too"
            )
        topology = _topology(module, device_mesh, dp_shard_dim, device, tp_dim)
    else:
        topology = hybrid_topology(
            device_mesh,
            dp_shard_dim=dp_shard_dim,
            dp_outer_dim=dp_outer_dim,
            hybrid_fsdp_group=hybrid_fsdp_group,
            outer_strategy=outer_strategy,
            tp_dim=tp_dim,
        )
    experts = expert_sharding(
        expt_device_mesh, dp_shard_dim=dp_shard_dim, tp_dim=tp_dim, dense=topology
    )
    return dict(
        module=module,
        fsdp_unit_modules=fsdp_unit_modules,
        experts=experts,
        sync_model_each_microbatch=sync_model_each_microbatch,
        init_model_with_meta_device=init_model_with_meta_device,
        mesh=topology,
        sharding_strategy=strategy,
        mp_policy=policy,
        overlap_grad_reduce=overlap_grad_reduce,
        overlap_param_gather=overlap_param_gather,
        average_in_collective=average_in_collective,
        gradient_scaling_factor=gradient_scaling_factor,
        calculate_per_token_loss=calculate_per_token_loss,
        report_nan_in_param_grad=report_nan_in_param_grad,
        # Persistent double buffers for the reduce-scatter inputs; gathered weights keep one
        # storage per unit whose bytes are freed after use (autograd holds views of it).
        grad_buffer_allocator="double_buffer" if fsdp_double_buffer else "plain",
        host_transport=host_transport,
        backward_prefetch_grad_fraction=backward_prefetch_grad_fraction,
        param_codecs=float8_codecs(),  # torchao float8 weights travel as float8 bytes
    )
