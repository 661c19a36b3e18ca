"""The reference's class arguments, ``MegatronFSDP(module, dist_index, ddp_config, ...)``, read
into ``fully_shard_model``'s, field by field, and so into the engine's ``ShardingOptions``.

The index gives the mesh arguments, the config the strategy, overlap, precision and buffer
choices. Each is passed on by name (mypy checks every one), except the five config fields the
constructor also takes as keywords (``ConfigKeywords``: its field names are the config's). A
keyword that contradicts the config raises instead of being dropped, as the reference drops it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from megatron_fsdp.ddp_config import DistributedDataParallelConfig
from megatron_fsdp.dist_index import FSDPDistributedIndex
from megatron_fsdp.engine_options import grad_buffer_choice, sharding_options
from megatron_fsdp.hybrid import names_hfsdp
from mfsdp_hooks import MixedPrecisionPolicy, ShardingOptions, UnitSpec
from mfsdp_te import convert_for_float8_param_gather

__all__ = ["ConfigKeywords", "reference_options"]


@dataclass(frozen=True)
class ConfigKeywords:
    """The config fields the reference's constructor also takes as keywords (None: not
    given)."""

    keep_fp8_transpose_cache: bool | None = None
    nccl_ub: bool | None = None
    fsdp_double_buffer: bool | None = None
    fsdp_db_use_persist_buf_on_alloc_fail: bool | None = None
    disable_symmetric_registration: bool | None = None

    def given(self) -> tuple[bool | None, ...]:
        return dataclasses.astuple(self)

    def config(self, ddp_config: object | None) -> DistributedDataParallelConfig:
        """``ddp_config`` (checked against these keywords), or the reference's default config
        with them."""
        given: dict[str, Any] = {k: v for k, v in dataclasses.asdict(self).items() if v is not None}
        if ddp_config is None:
            return DistributedDataParallelConfig(
                data_parallel_sharding_strategy="optim_grads_params",
                overlap_grad_reduce=True,
                overlap_param_gather=True,
                **given,
            )
        config = DistributedDataParallelConfig.from_any(ddp_config)
        clashing = [name for name, value in given.items() if value != getattr(config, name)]
        if clashing:
            raise ValueError(
                f"MegatronFSDP keyword(s) {clashing} contradict ddp_config (the reference "
                "silently drops them when a config is given): set them in the config"
            )
        return config


def reference_options(
    module: nn.Module,
    fsdp_unit_modules: Sequence[UnitSpec] | None,
    dist_index: FSDPDistributedIndex,
    config: DistributedDataParallelConfig,
    mixed_precision_policy: MixedPrecisionPolicy | None,
    *,
    device: torch.device | str | None,
    calculate_per_token_loss: bool,
    init_model_with_meta_device: bool,
    sync_model_each_microbatch: bool,
    report_nan_in_param_grad: bool,
    fine_grained_param_gather: bool = False,
) -> ShardingOptions:
    """The engine's options for the reference's constructor arguments
    (``fine_grained_param_gather``: its ``enable_fine_grained_param_gather_hook`` keyword,
    which the config's ``megatron_fsdp_enable_fine_grained_param_gather`` also turns on)."""
    config.refuse_unsupported()
    if config.fp8_param_gather:  # float8 compute weights gathered as float8 (torchao)
        convert_for_float8_param_gather(module, "ddp_config.fp8_param_gather")
    policy = config.precision_policy()
    if mixed_precision_policy is not None:
        if policy is not None:
            raise ValueError(
                "mixed_precision_policy was given and ddp_config sets precision fields too: "
                "set the dtypes in one of them"
            )
        policy = mixed_precision_policy
    _check_hsdp_fields(config, dist_index)
    options = sharding_options(
        module,
        fsdp_unit_modules,
        device_mesh=dist_index.device_mesh,
        dp_shard_dim=dist_index.dp_shard_dim,
        dp_outer_dim=dist_index.dp_outer_dim,
        tp_dim=dist_index.tp_dim,
        hybrid_fsdp_group=dist_index.hybrid_fsdp_group,
        expt_device_mesh=dist_index.expt_device_mesh,
        device=device,
        mixed_precision_policy=policy,
        zero_dp_strategy=config.data_parallel_sharding_strategy,
        outer_dp_sharding_strategy=config.outer_dp_sharding_strategy,
        init_model_with_meta_device=init_model_with_meta_device,
        overlap_grad_reduce=config.overlap_grad_reduce,
        overlap_param_gather=config.overlap_param_gather,
        sync_model_each_microbatch=sync_model_each_microbatch,
        average_in_collective=config.average_in_collective,
        calculate_per_token_loss=calculate_per_token_loss,
        report_nan_in_param_grad=report_nan_in_param_grad or config.check_for_nan_in_grad,
        keep_fp8_transpose_cache=config.keep_fp8_transpose_cache,
        nccl_ub=config.nccl_ub,
        fsdp_manual_registration=config.fsdp_manual_registration,
        disable_symmetric_registration=config.disable_symmetric_registration,
        enable_fine_grained_param_gather=(
            fine_grained_param_gather or config.megatron_fsdp_enable_fine_grained_param_gather
        ),
        fsdp_double_buffer=config.fsdp_double_buffer,
        fsdp_db_use_persist_buf_on_alloc_fail=config.fsdp_db_use_persist_buf_on_alloc_fail,
        use_decoupled_grad=config.megatron_fsdp_use_decoupled_grad,
        reshard_after_forward_group_size=config.reshard_after_forward_group_size,
        check_replicas=config.check_replicas,
        optimizer_cpu_offload=config.optimizer_cpu_offload,
    )
    return _with_config_only_fields(options, config)


def _check_hsdp_fields(
    config: DistributedDataParallelConfig, dist_index: FSDPDistributedIndex
) -> None:
    """The config's HSDP fields agree with the index's mesh."""
    instances = config.num_distributed_optimizer_instances
    outer = dist_index.outer_fsdp_group
    if instances > 1 and (outer is None or outer.size() != instances):
        raise ValueError(
            f"ddp_config.num_distributed_optimizer_instances={instances} asks for HSDP over "
            f"{instances} replicas, but dist_index has "
            + ("no dp_outer_dim" if outer is None else f"a dp_outer dim of {outer.size()}")
            + f": give FSDPDistributedIndex a dp_outer_dim of size {instances}, or leave "
            "num_distributed_optimizer_instances at 1"
        )
    outer_sharded = names_hfsdp(config.outer_dp_sharding_strategy)
    if dist_index.hsdp_outer_dp_shard != outer_sharded:
        raise ValueError(
            f"FSDPDistributedIndex(hsdp_outer_dp_shard={dist_index.hsdp_outer_dp_shard}) "
            f"contradicts ddp_config.outer_dp_sharding_strategy="
            f"{config.outer_dp_sharding_strategy!r}: set both for HFSDP, neither for HSDP"
        )


def _with_config_only_fields(
    options: ShardingOptions, config: DistributedDataParallelConfig
) -> ShardingOptions:
    """The fields ``fully_shard_model`` has no keyword for, as in the reference:
    ``megatron_fsdp_max_pool_double_buffer`` (one pool sized for the largest unit),
    ``bucket_size`` (a unit's collectives of at most so many elements) and
    ``suggested_communication_unit_size`` (the elements gathered ahead, small units merged
    into one all-gather up to it)."""
    if config.megatron_fsdp_max_pool_double_buffer:
        allocator = grad_buffer_choice(
            config.fsdp_double_buffer, config.fsdp_db_use_persist_buf_on_alloc_fail, max_pool=True
        )
        options = dataclasses.replace(options, grad_buffer_allocator=allocator)
    return dataclasses.replace(
        options,
        max_bucket_numel=_elements(config.bucket_size, "bucket_size"),
        prefetch_numel=_elements(
            config.suggested_communication_unit_size, "suggested_communication_unit_size"
        ),
        coalesce_prefetch=config.suggested_communication_unit_size is not None,
    )


def _elements(value: object, field: str) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(
            f"ddp_config.{field}={value!r}: give a number of elements (an int >= 0) or None"
        )
    return value
