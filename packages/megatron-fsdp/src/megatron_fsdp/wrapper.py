"""``MegatronFSDP``: the reference's class entry point, over the engine's root wrapper.

``MegatronFSDP(module, dist_index, ddp_config=..., mixed_precision_policy=...,
fsdp_unit_modules=..., device=..., ...)`` as NVIDIA's Megatron-FSDP takes it: the index
names the mesh dims, the config the strategy and options; both become ``fully_shard_model``
arguments (``engine_options``), so the two entry points build the same thing, and
``fully_shard_model`` returns an instance of this class. A keyword that contradicts the
config raises instead of being dropped.

Beyond the engine wrapper's ``no_sync``/``finish_grad_sync``/``zero_grad_buffer``/
``install_optimized_model_weights``: ``broadcast_params``, ``scale_gradients``, ``sync``,
``set_model_auto_sync``, ``is_last_microbatch``, ``microbatch_count``, ``start_grad_sync``
and ``start_param_sync``, as the reference has them. ``mixed_precision_context`` raises
``NotImplementedError`` saying why.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import mfsdp_hooks
from megatron_fsdp.ddp_config import DistributedDataParallelConfig
from megatron_fsdp.dist_index import FSDPDistributedIndex
from megatron_fsdp.engine_options import engine_kwargs
from mfsdp_hooks import MixedPrecisionPolicy, ShardingStrategy, UnitSpec, fsdp_units

__all__ = ["MegatronFSDP"]

_CONFIG_KEYWORDS = (
    "keep_fp8_transpose_cache",
    "nccl_ub",
    "fsdp_double_buffer",
    "fsdp_db_use_persist_buf_on_alloc_fail",
    "disable_symmetric_registration",
)


class MegatronFSDP(mfsdp_hooks.MegatronFSDP):
    """The reference's constructor; see the module docstring."""

    ddp_config: DistributedDataParallelConfig | None
    """The config it was built from (None when built by ``fully_shard_model``)."""
    dist_index: FSDPDistributedIndex | None

    def __init__(
        self,
        module: nn.Module,
        dist_index: FSDPDistributedIndex,
        ddp_config: DistributedDataParallelConfig | None = None,
        mixed_precision_policy: MixedPrecisionPolicy | None = None,
        fsdp_unit_modules: Sequence[UnitSpec] | None = None,
        device: torch.device | str | None = None,
        calculate_per_token_loss: bool = False,
        init_model_with_meta_device: bool = False,
        sync_model_each_microbatch: bool = False,
        report_nan_in_param_grad: bool = False,
        **keywords: Any,
    ) -> None:
        if not isinstance(dist_index, FSDPDistributedIndex):
            raise TypeError(
                f"dist_index must be a megatron_fsdp.FSDPDistributedIndex, got "
                f"{type(dist_index).__name__}"
            )
        config = _config(ddp_config, keywords)
        options = {**dist_index.engine_options(), **config.engine_options()}
        if mixed_precision_policy is not None:
            if "mixed_precision_policy" in options or "grad_reduce_in_fp32" in options:
                raise ValueError(
                    "mixed_precision_policy was given and ddp_config sets precision fields too: "
                    "set the dtypes in one of them"
                )
            options["mixed_precision_policy"] = mixed_precision_policy
        outer_sharded = config.outer_dp_sharding_strategy in ("optim", 1)
        if dist_index.hsdp_outer_dp_shard != outer_sharded:
            raise ValueError(
                f"FSDPDistributedIndex(hsdp_outer_dp_shard={dist_index.hsdp_outer_dp_shard}) "
                f"contradicts ddp_config.outer_dp_sharding_strategy="
                f"{config.outer_dp_sharding_strategy!r}: set both for HFSDP, neither for HSDP"
            )
        kwargs = engine_kwargs(
            module,
            fsdp_unit_modules,
            device=device,
            calculate_per_token_loss=calculate_per_token_loss,
            init_model_with_meta_device=init_model_with_meta_device,
            sync_model_each_microbatch=sync_model_each_microbatch,
            report_nan_in_param_grad=report_nan_in_param_grad or config.check_for_nan_in_grad,
            **{k: v for k, v in options.items() if k != "report_nan_in_param_grad"},
        )
        self._setup(kwargs)
        self.ddp_config, self.dist_index = config, dist_index

    @classmethod
    def from_engine_kwargs(cls, kwargs: dict[str, Any]) -> MegatronFSDP:
        """``fully_shard_model``'s way in: the arguments ``engine_kwargs`` checked."""
        wrapped = cls.__new__(cls)
        wrapped._setup(kwargs)
        return wrapped

    def _setup(self, kwargs: dict[str, Any]) -> None:
        kwargs = dict(kwargs)
        module, units = kwargs.pop("module"), kwargs.pop("fsdp_unit_modules")
        strategy = kwargs["sharding_strategy"]
        if not units and strategy != ShardingStrategy.NO_SHARD:
            # The seed README: required for strategies 1-3. Without units the whole model
            # would be one unit, every weight gathered at once.
            raise ValueError(
                f"fsdp_unit_modules is required with zero_dp_strategy={int(strategy)} "
                f"({strategy.name.lower()}): pass the class of the model's repeated blocks, "
                "e.g. fsdp_unit_modules=[TransformerBlock] (or [type(model)] for one "
                "whole-model unit), or use zero_dp_strategy=0 to replicate like DDP"
            )
        mfsdp_hooks.MegatronFSDP.__init__(self, module, units, **kwargs)
        self.ddp_config = None
        self.dist_index = None

    # ------------------------------------------------------------ the reference's methods
    def finish_grad_sync(self, force_all_reduce: bool | None = False) -> None:
        """Wait for and finish every gradient reduction (``force_all_reduce``: Megatron-Core's
        argument, which the reference ignores too: every synced step reduces everything)."""
        del force_all_reduce
        super().finish_grad_sync()

    @contextlib.contextmanager
    def sync(self) -> Iterator[None]:
        """Turn auto-sync on (every backward finishes its reductions) and, as the reference
        does, off again on exit (not back to what it was)."""
        self.set_requires_gradient_sync(True)
        self.set_model_auto_sync(True)
        try:
            yield
        finally:
            self.set_model_auto_sync(False)

    def start_param_sync(self, *unused: Any, force_sync: bool = False, **_: Any) -> None:
        """Bring the compute weights up to date with the optimizer's now (the engine would
        at the next forward); ``force_sync`` is implied: the gathers are waited on."""
        del unused, force_sync
        self.install_optimized_model_weights()

    def start_grad_sync(self, *unused: Any) -> None:
        """Launch the reductions ``no_sync`` micro-batches left local, without waiting
        (Megatron-Core's ``grad_sync_func``); the rest started in backward already."""
        del unused
        super().start_grad_sync()

    def set_model_auto_sync(self, sync_model: bool = True) -> None:
        """True: every backward finishes its gradient reductions (``finish_grad_sync`` after
        each micro-batch, as ``sync_model_each_microbatch=True`` does); False: ``no_sync``
        micro-batches leave theirs in flight and the optimizer step finishes them."""
        self.root_unit_module.set_sync_model_each_microbatch(bool(sync_model))

    @property
    def model_auto_sync(self) -> bool:
        return self.root_unit_module.sync_model_each_microbatch

    @property
    def is_last_microbatch(self) -> bool:
        """False inside ``no_sync`` (gradients accumulate unreduced), True outside it."""
        return self.root_unit_module.requires_gradient_sync

    @is_last_microbatch.setter
    def is_last_microbatch(self, value: bool) -> None:
        self.set_requires_gradient_sync(bool(value))

    @property
    def microbatch_count(self) -> int:
        """Backward passes since the last ``finish_grad_sync`` (0 while auto-sync is on)."""
        root = self.root_unit_module.fsdp_root
        return 0 if root is None else root.microbatch_count

    def mixed_precision_context(self, policy: MixedPrecisionPolicy) -> Any:
        """Not supported yet: the policy is fixed when the buffers are built."""
        raise NotImplementedError(
            "MegatronFSDP.mixed_precision_context: switching the precision policy of built "
            "buffers is not supported yet"
        )

    def broadcast_params(self) -> None:
        """Every rank's weights from data-parallel rank 0 (``--data-parallel-random-init``):
        the main weights over each group's DP group, then the compute weights re-installed."""
        for unit in fsdp_units(self.module):
            for group in unit.groups:
                topology = group.topology
                source = group.main if group.main is not None else group.model
                if not source.sharded and topology.shard_size > 1:
                    first = dist.get_global_rank(topology.shard_group, 0)
                    dist.broadcast(source.materialize(), first, group=topology.shard_group)
                outer = topology.outer_group
                if outer is not None and source.has_persistent_shard:
                    dist.broadcast(source.shard, dist.get_global_rank(outer, 0), group=outer)
                group.mark_weights_dirty()

    def scale_gradients(self, scaling_factor: float) -> None:
        """Multiply every reduced gradient by ``scaling_factor`` (Megatron-Core's loss scaling
        and per-token normalisation call this after the reduction)."""
        for unit in fsdp_units(self.module):
            for group in unit.groups:
                if group.grads is not None and group.grads.storage is not None:
                    group.grads.storage.mul_(scaling_factor)


def _config(
    ddp_config: DistributedDataParallelConfig | None, keywords: dict[str, Any]
) -> DistributedDataParallelConfig:
    unknown = sorted(set(keywords) - set(_CONFIG_KEYWORDS))
    if unknown:
        raise TypeError(f"MegatronFSDP() got unexpected keyword argument(s) {unknown}")
    if ddp_config is None:  # the reference's default config, with these keywords
        return DistributedDataParallelConfig(
            data_parallel_sharding_strategy="optim_grads_params",
            overlap_grad_reduce=True,
            overlap_param_gather=True,
            **keywords,
        )
    ddp_config = DistributedDataParallelConfig.from_any(ddp_config)
    clashing = [k for k, v in keywords.items() if v != getattr(ddp_config, k)]
    if clashing:
        raise ValueError(
            f"MegatronFSDP keyword(s) {clashing} contradict ddp_config (the reference silently "
            "drops them when a config is given): set them in the config"
        )
    return ddp_config
