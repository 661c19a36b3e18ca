"""``MegatronFSDP``: the reference's class entry point, over the engine's root wrapper.

``MegatronFSDP(module, dist_index, ddp_config, ...)`` as NVIDIA's Megatron-FSDP takes it: the
index and config become ``fully_shard_model`` arguments, field by field
(``reference_options``), so both entry points build the same thing. Its methods beyond the
engine wrapper's are the reference's (the package README lists them).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

import mfsdp_hooks
from megatron_fsdp.ddp_config import DistributedDataParallelConfig
from megatron_fsdp.dist_index import FSDPDistributedIndex
from megatron_fsdp.hf_export import save_pretrained
from megatron_fsdp.reference_options import ConfigKeywords, reference_options
from mfsdp_hooks import MixedPrecisionPolicy, ShardingOptions, UnitSpec

__all__ = ["MegatronFSDP"]


class MegatronFSDP(mfsdp_hooks.FSDPRootWrapper):
    """The reference's constructor; ``MegatronFSDP(module, fsdp_unit_modules=...,
    options=ShardingOptions(...))`` builds it from a checked options record instead (what
    ``fully_shard_model`` does), the reference's other arguments left out."""

    ddp_config: DistributedDataParallelConfig | None
    """The config it was built from (None when built from an options record)."""
    dist_index: FSDPDistributedIndex | None

    def __init__(
        self,
        module: nn.Module,
        dist_index: FSDPDistributedIndex | None = None,
        ddp_config: DistributedDataParallelConfig | None = None,
        mixed_precision_policy: MixedPrecisionPolicy | None = None,
        fsdp_unit_modules: Sequence[UnitSpec] | None = None,
        device: torch.device | str | None = None,
        calculate_per_token_loss: bool = False,
        init_model_with_meta_device: bool = False,
        sync_model_each_microbatch: bool = False,
        report_nan_in_param_grad: bool = False,
        *,
        keep_fp8_transpose_cache: bool | None = None,
        nccl_ub: bool | None = None,
        fsdp_double_buffer: bool | None = None,
        fsdp_db_use_persist_buf_on_alloc_fail: bool | None = None,
        disable_symmetric_registration: bool | None = None,
        enable_fine_grained_param_gather_hook: bool = False,
        options: ShardingOptions | None = None,
    ) -> None:
        keywords = ConfigKeywords(
            keep_fp8_transpose_cache=keep_fp8_transpose_cache,
            nccl_ub=nccl_ub,
            fsdp_double_buffer=fsdp_double_buffer,
            fsdp_db_use_persist_buf_on_alloc_fail=fsdp_db_use_persist_buf_on_alloc_fail,
            disable_symmetric_registration=disable_symmetric_registration,
        )
        config = None
        if options is None:
            if not isinstance(dist_index, FSDPDistributedIndex):
                raise TypeError(
                    f"dist_index must be a megatron_fsdp.FSDPDistributedIndex, got "
                    f"{type(dist_index).__name__}"
                )
            config = keywords.config(ddp_config)
            options = reference_options(
                module,
                fsdp_unit_modules,
                dist_index,
                config,
                mixed_precision_policy,
                device=device,
                calculate_per_token_loss=calculate_per_token_loss,
                init_model_with_meta_device=init_model_with_meta_device,
                sync_model_each_microbatch=sync_model_each_microbatch,
                report_nan_in_param_grad=report_nan_in_param_grad,
                fine_grained_param_gather=enable_fine_grained_param_gather_hook,
            )
        else:
            given = (dist_index, ddp_config, mixed_precision_policy, device, *keywords.given())
            flags = (
                calculate_per_token_loss,
                init_model_with_meta_device,
                report_nan_in_param_grad,
                enable_fine_grained_param_gather_hook,
            )
            if any(v is not None for v in given) or any(flags) or sync_model_each_microbatch:
                raise TypeError(
                    "MegatronFSDP(options=...): the options record carries every choice; leave "
                    "dist_index, ddp_config and the other reference arguments out"
                )
        super().__init__(module, fsdp_unit_modules, options)
        self.ddp_config, self.dist_index = config, dist_index
        # False: start_param_sync leaves the gathers to each unit's next forward.
        self._gather_in_start_param_sync = (
            config is None or config.fsdp_all_gather_in_start_param_sync
        )

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
        """Bring the compute weights up to date with the optimizer's now; the gathers are
        waited on. With ``ddp_config.fsdp_all_gather_in_start_param_sync=False`` nothing is
        gathered here unless ``force_sync``: each unit's next forward installs the stepped
        weights as it gathers them (the engine tracks which are stale)."""
        del unused
        if self._gather_in_start_param_sync or force_sync:
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

    def save_pretrained(
        self, save_directory: str | Path, *, dtype: torch.dtype | None = None, **unsupported: Any
    ) -> Path:
        """The wrapped Hugging Face model's ``save_pretrained``, sharded: ``config.json`` +
        ``model.safetensors`` that ``from_pretrained`` loads (``megatron_fsdp.hf_export``).
        Collective: call it on every rank. The model's own ``save_pretrained`` would write
        each rank's shard, so the wrapper answers this name itself."""
        if unsupported:
            raise TypeError(
                f"save_pretrained({', '.join(sorted(unsupported))}=...): not supported on a "
                "sharded model; it takes save_directory and dtype (the weights stream into one "
                "model.safetensors)"
            )
        return save_pretrained(self, save_directory, dtype=dtype)
