"""The reference's ``DistributedDataParallelConfig``: its fields, honoured or refused.

Every field is read: the engine's become ``fully_shard_model`` arguments (``reference_options``),
the others raise ``NotImplementedError`` naming the field when set (``megatron_fsdp.unsupported``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch

from megatron_fsdp.unsupported import refuse_unsupported
from mfsdp_hooks import MixedPrecisionPolicy

__all__ = ["DistributedDataParallelConfig"]


@dataclass
class DistributedDataParallelConfig:
    """The reference's config fields (its current release, and the older
    ``grad_reduce_in_fp32``/``preserve_fp32_weights`` that ``fully_shard_model`` keeps)."""

    data_parallel_sharding_strategy: str = "no_shard"
    outer_dp_sharding_strategy: str = "no_shard"
    overlap_grad_reduce: bool = False
    overlap_param_gather: bool = False
    check_for_nan_in_grad: bool = False
    average_in_collective: bool = False
    gradient_reduce_div_fusion: bool = True
    """A fused 1/N scaling: ours always folds it into the reduction, so either is honoured."""
    keep_fp8_transpose_cache: bool = False
    nccl_ub: bool = False
    fsdp_double_buffer: bool = False
    disable_symmetric_registration: bool = False
    fsdp_manual_registration: bool = False
    megatron_fsdp_main_params_dtype: torch.dtype | None = torch.float32
    megatron_fsdp_main_grads_dtype: torch.dtype | None = None
    megatron_fsdp_grad_comm_dtype: torch.dtype | None = None
    grad_reduce_in_fp32: bool = False
    preserve_fp32_weights: bool = True
    fp8_param_gather: bool = False
    bucket_size: int | None = None
    suggested_communication_unit_size: int | None = None
    fsdp_all_gather_in_start_param_sync: bool = True
    fsdp_db_use_persist_buf_on_alloc_fail: bool = False
    megatron_fsdp_use_decoupled_grad: bool = False
    megatron_fsdp_cuda_graph_mode: bool = False
    megatron_fsdp_enable_fine_grained_param_gather: bool = False
    megatron_fsdp_max_pool_double_buffer: bool = False
    reshard_after_forward_group_size: int | None = None
    """Not in the reference: ``fully_shard_model(reshard_after_forward_group_size=...)``.
    Megatron-Core's config has no such field: pass this class as the adapter's ``ddp_config``."""
    check_replicas: bool = True
    """Not in the reference: compare the weights' values across the ranks at wrap time and
    raise when they differ (``fully_shard_model(check_replicas=...)``)."""
    optimizer_cpu_offload: bool = False
    """``fully_shard_model(optimizer_cpu_offload=...)``, decided when the model is wrapped; set
    it here, not in Megatron-Core's ``OptimizerConfig`` (the package README, "Host offload
    with Megatron-Core")."""
    use_distributed_optimizer: bool = False
    """Megatron-Core sets it with FSDP: an optimizer over sharded parameters is distributed
    by construction, so either value is honoured."""
    num_distributed_optimizer_instances: int = 1
    use_megatron_fsdp: bool = False
    """Megatron-Core's switch; this package is Megatron-FSDP whatever it says."""

    @classmethod
    def from_any(
        cls, config: object, argument: str = "ddp_config"
    ) -> DistributedDataParallelConfig:
        """This class for ``config``: itself, or a copy of another dataclass with these field
        names (Megatron-Core's ``DistributedDataParallelConfig``, which the reference reads
        when Megatron-Core is installed). A field we do not have, set to anything but its
        default, raises naming it."""
        if isinstance(config, cls):
            return config
        if not dataclasses.is_dataclass(config) or isinstance(config, type):
            raise TypeError(
                f"{argument} must be a megatron_fsdp.DistributedDataParallelConfig (or "
                f"Megatron-Core's), got {type(config).__name__}"
            )
        ours = {f.name for f in dataclasses.fields(cls)}
        copied: dict[str, Any] = {}
        for field in dataclasses.fields(config):
            value = getattr(config, field.name)
            if field.name in ours:
                copied[field.name] = value
            elif value != _default_of(field):
                raise NotImplementedError(
                    f"{argument}.{field.name}={value!r} ({type(config).__module__}."
                    f"{type(config).__name__}) has no counterpart in megatron-fsdp yet; leave "
                    f"it at its default {_default_of(field)!r}"
                )
        return cls(**copied)

    def refuse_unsupported(self) -> None:
        """Raise naming the first field set that megatron-fsdp does not support yet (the
        table in ``megatron_fsdp.unsupported``; the fields that are also ``fully_shard_model``
        arguments are refused there, under those names)."""
        refuse_unsupported("ddp_config", self)

    def precision_policy(self) -> MixedPrecisionPolicy | None:
        """The policy these fields ask for; None when they leave precision at its default."""
        legacy = self.grad_reduce_in_fp32 or not self.preserve_fp32_weights
        dtypes = (self.megatron_fsdp_main_grads_dtype, self.megatron_fsdp_grad_comm_dtype)
        if legacy and (self.megatron_fsdp_main_params_dtype != torch.float32 or any(dtypes)):
            raise ValueError(
                "DistributedDataParallelConfig: set either grad_reduce_in_fp32/"
                "preserve_fp32_weights or the megatron_fsdp_*_dtype fields, not both"
            )
        if legacy:  # as fully_shard_model reads its two legacy arguments
            return MixedPrecisionPolicy(
                reduce_dtype=torch.float32 if self.grad_reduce_in_fp32 else None,
                main_params_dtype=torch.float32 if self.preserve_fp32_weights else None,
            )
        policy = MixedPrecisionPolicy(
            main_params_dtype=self.megatron_fsdp_main_params_dtype,
            main_grads_dtype=self.megatron_fsdp_main_grads_dtype,
            reduce_dtype=self.megatron_fsdp_grad_comm_dtype,
        )
        return None if policy == MixedPrecisionPolicy() else policy


def _default_of(field: dataclasses.Field[Any]) -> Any:
    if field.default is not dataclasses.MISSING:
        return field.default
    if field.default_factory is not dataclasses.MISSING:
        return field.default_factory()
    return dataclasses.MISSING
