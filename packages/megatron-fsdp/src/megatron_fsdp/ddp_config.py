"""The reference's ``DistributedDataParallelConfig``: its fields, honoured or refused.

Code written for NVIDIA's Megatron-FSDP builds one of these and passes it to
``MegatronFSDP(module, dist_index, ddp_config=...)``. Every field is read: the ones the engine
has are mapped onto its options (:meth:`DistributedDataParallelConfig.engine_options`), the
ones it does not have raise ``NotImplementedError`` naming the field when set to anything
but their default, so no setting is dropped. (The reference ignores its own ``nccl_ub``,
``fsdp_double_buffer`` and FP8 keywords when a config is passed; here a keyword that
contradicts the config is an error.)
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["DistributedDataParallelConfig"]

# field -> (default, what it would need)
_NOT_YET: dict[str, tuple[Any, str]] = {
    "fp8_param_gather": (False, "FP8 parameters from the config (use torchao float8 models)"),
    "bucket_size": (None, "a bucket-size cap (units are the buckets)"),
    "suggested_communication_unit_size": (None, "a communication unit size (units are)"),
    "fsdp_all_gather_in_start_param_sync": (True, "start_param_sync"),
    "fsdp_db_use_persist_buf_on_alloc_fail": (False, "the double buffer's fallback"),
    "megatron_fsdp_use_decoupled_grad": (False, "decoupled gradients"),
    "megatron_fsdp_cuda_graph_mode": (False, "CUDA-graph mode"),
    "megatron_fsdp_enable_fine_grained_param_gather": (False, "fine-grained all-gather"),
    "megatron_fsdp_max_pool_double_buffer": (False, "the max-pool double buffer"),
    "num_distributed_optimizer_instances": (1, "partial distributed optimizers"),
}


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
        for name, (default, feature) in _NOT_YET.items():
            value = getattr(self, name)
            if value != default:
                raise NotImplementedError(
                    f"DistributedDataParallelConfig.{name}={value!r}: {feature} is not "
                    f"supported yet by megatron-fsdp; leave it at {default!r}"
                )

    def precision_policy(self) -> dict[str, Any]:
        """``fully_shard_model``'s precision arguments for these fields."""
        legacy = self.grad_reduce_in_fp32 or not self.preserve_fp32_weights
        dtypes = (self.megatron_fsdp_main_grads_dtype, self.megatron_fsdp_grad_comm_dtype)
        if legacy and (self.megatron_fsdp_main_params_dtype != torch.float32 or any(dtypes)):
            raise ValueError(
                "DistributedDataParallelConfig: set either grad_reduce_in_fp32/"
                "preserve_fp32_weights or the megatron_fsdp_*_dtype fields, not both"
            )
        if legacy:
            return {
                "grad_reduce_in_fp32": self.grad_reduce_in_fp32,
                "preserve_fp32_weights": self.preserve_fp32_weights,
            }
        from mfsdp_hooks import MixedPrecisionPolicy

        policy = MixedPrecisionPolicy(
            main_params_dtype=self.megatron_fsdp_main_params_dtype,
            main_grads_dtype=self.megatron_fsdp_main_grads_dtype,
            reduce_dtype=self.megatron_fsdp_grad_comm_dtype,
        )
        return {} if policy == MixedPrecisionPolicy() else {"mixed_precision_policy": policy}

    def engine_options(self) -> dict[str, Any]:
        """``fully_shard_model`` keyword arguments for this config (refusing what is not
        supported yet)."""
        self.refuse_unsupported()
        return {
            "zero_dp_strategy": self.data_parallel_sharding_strategy,
            "outer_dp_sharding_strategy": self.outer_dp_sharding_strategy,
            "overlap_grad_reduce": self.overlap_grad_reduce,
            "overlap_param_gather": self.overlap_param_gather,
            "report_nan_in_param_grad": self.check_for_nan_in_grad,
            "average_in_collective": self.average_in_collective,
            "keep_fp8_transpose_cache": self.keep_fp8_transpose_cache,
            "nccl_ub": self.nccl_ub,
            "fsdp_double_buffer": self.fsdp_double_buffer,
            "disable_symmetric_registration": self.disable_symmetric_registration,
            "fsdp_manual_registration": self.fsdp_manual_registration,
            **self.precision_policy(),
        }


def _default_of(field: dataclasses.Field[Any]) -> Any:
    if field.default is not dataclasses.MISSING:
        return field.default
    if field.default_factory is not dataclasses.MISSING:
        return field.default_factory()
    return dataclasses.MISSING
