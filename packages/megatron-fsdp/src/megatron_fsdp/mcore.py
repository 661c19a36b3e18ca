"""Megatron-Core's ``FullyShardedDataParallel``, for training loops written against it.

What it does, supports and refuses: the package README, "Megatron-Core". Nothing here needs
``megatron.core``: the config is read by its public field names, the groups found by
``megatron_fsdp.mcore_groups``.
"""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from megatron_fsdp.ddp_config import DistributedDataParallelConfig
from megatron_fsdp.hybrid import names_hfsdp
from megatron_fsdp.mcore_groups import data_parallel_index
from megatron_fsdp.unsupported import refuse_unsupported
from megatron_fsdp.wrapper import MegatronFSDP
from mfsdp_checkpoint import WRAPPER_PREFIX, enable_dcp
from mfsdp_hooks import MixedPrecisionPolicy, ShardingStrategy, UnitSpec, parse_strategy

__all__ = ["FullyShardedDataParallel", "MCoreFSDPModel"]

# Megatron-Core's default units (used when it is installed and fsdp_unit_modules is None).
_MCORE_UNITS = (
    "megatron.core.transformer.transformer_layer.TransformerLayer",
    "megatron.core.transformer.moe.moe_layer.MoETransformerLayer",
    "megatron.core.ssm.mamba_layer.MambaLayer",
)


def FullyShardedDataParallel(
    config: Any,
    ddp_config: Any,
    module: Any,
    fsdp_unit_modules: Sequence[UnitSpec] | None = None,
    disable_bucketing: bool = False,
    device: torch.device | str | None = None,
    pg_collection: Any = None,
) -> MCoreFSDPModel:
    """Megatron-Core's wrapper, returning a chunk that holds a ``MegatronFSDP`` at ``.module``.
    ``module`` and ``ddp_config`` may come in either order (older releases and the seeds'
    guide differ), told apart by type."""
    if isinstance(ddp_config, nn.Module) and not isinstance(module, nn.Module):
        ddp_config, module = module, ddp_config
    if not isinstance(module, nn.Module):
        raise TypeError(f"module must be an nn.Module, got {type(module).__name__}")
    return MCoreFSDPModel(
        config,
        DistributedDataParallelConfig.from_any(ddp_config),
        module,
        fsdp_unit_modules=fsdp_unit_modules,
        disable_bucketing=disable_bucketing,
        device=device,
        pg_collection=pg_collection,
    )


class MCoreFSDPModel(nn.Module):
    """A model chunk as Megatron-Core's training loop and optimizer use it."""

    def __init__(
        self,
        config: Any,
        ddp_config: DistributedDataParallelConfig,
        module: nn.Module,
        *,
        fsdp_unit_modules: Sequence[UnitSpec] | None,
        disable_bucketing: bool,
        device: torch.device | str | None,
        pg_collection: Any,
    ) -> None:
        super().__init__()
        _refuse_unsupported_parallelism(config, ddp_config, module, pg_collection)
        del disable_bucketing  # units are the buckets: there is no other bucketing to disable
        device_type = torch.device(device).type if device is not None else _default_device()
        self.config = config
        self.ddp_config = ddp_config
        self.megatron_fsdp_dist_index = data_parallel_index(
            config,
            int(ddp_config.num_distributed_optimizer_instances),
            names_hfsdp(ddp_config.outer_dp_sharding_strategy),
            pg_collection,
            device_type,
        )
        self.fsdp_unit_modules = _default_units(fsdp_unit_modules, ddp_config)
        self.module = MegatronFSDP(
            module,
            self.megatron_fsdp_dist_index,
            ddp_config,
            fsdp_unit_modules=self.fsdp_unit_modules,
            device=device,
            calculate_per_token_loss=bool(getattr(config, "calculate_per_token_loss", False)),
            init_model_with_meta_device=bool(getattr(config, "init_model_with_meta_device", False)),
        )
        enable_dcp(self.module)  # Megatron-Core saves DTensor state dicts ("fsdp_dtensor")
        self.param_and_grad_buffer = ParamAndGradBuffer(self.module)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)

    # ------------------------------------------------- what a Megatron-Core loop calls
    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        with self.module.no_sync():
            yield

    def start_grad_sync(self, *unused: Any) -> None:
        self.module.start_grad_sync()

    def finish_grad_sync(self, force_all_reduce: bool | None = False) -> None:
        self.module.finish_grad_sync(force_all_reduce)

    def scale_gradients(self, scaling_factor: float) -> None:
        self.module.scale_gradients(scaling_factor)

    def zero_grad_buffer(self) -> None:
        self.module.zero_grad_buffer()

    def broadcast_params(self) -> None:
        self.module.broadcast_params()

    def start_param_sync(self, *unused: Any, force_sync: bool = False, **_: Any) -> None:
        self.module.start_param_sync(force_sync=force_sync)

    def mixed_precision_context(self, policy: Any) -> contextlib.AbstractContextManager[None]:
        """The wrapped ``MegatronFSDP``'s: another mixed-precision policy for a region."""
        return self.module.mixed_precision_context(policy)

    @property
    def mixed_precision_policy(self) -> MixedPrecisionPolicy:
        """The policy the chunk was wrapped with (a region's starting point)."""
        policy: MixedPrecisionPolicy = self.module.mixed_precision_policy
        return policy

    def synchronize_param_gather(self) -> None:
        """Nothing to wait for: every all-gather is waited on by the forward that needs it,
        and none is left in flight once a forward returns."""

    def stop_communication(self) -> None:
        """Finish every gradient reduction (parameter gathers never outlive a forward)."""
        self.module.finish_grad_sync()

    # ------------------------------------------------- checkpoints
    def state_dict_for_save_checkpoint(self, prefix: str = "", keep_vars: bool = False) -> Any:
        return self.module.state_dict(prefix=prefix, keep_vars=keep_vars)

    def sharded_state_dict(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError(
            "sharded_state_dict: Megatron-Core's dist-checkpointing (torch_dist) format is not "
            "supported by megatron-fsdp, as by Megatron-FSDP; save with ckpt_format "
            "'fsdp_dtensor': megatron_fsdp.mcore_checkpoint.save_fsdp_dtensor(directory, "
            "chunks, optimizer, iteration=...) and load_fsdp_dtensor, which reshard across "
            "TP/PP/EP/DP layouts"
        )

    def state_dict(self, *args: Any, **kwargs: Any) -> Any:
        """The wrapped model's (keys ``module.*``), as Megatron-Core's chunk returns it."""
        return self.module.state_dict(*args, **kwargs)

    def load_state_dict(
        self, state_dict: Mapping[str, Any], strict: bool = True, assign: bool = False
    ) -> Any:
        """Keys with the ``module.`` prefix, or all without it (Megatron-Core adds it)."""
        if strict and not state_dict:
            # What torch's set_model_state_dict(broadcast_from_rank0=True) hands a receiving
            # rank: it matches rank 0's keys (ours, module.X) against parameter paths
            # (module.module.X) and keeps nothing. Said here rather than as a key list.
            raise RuntimeError(
                "load_state_dict: the state dict is empty. From torch's set_model_state_dict "
                "on a Megatron-Core chunk, pass chunk.module (the MegatronFSDP it wraps): the "
                "chunk's state_dict() keeps Megatron-Core's keys (module.*), one level fewer "
                "than its parameter paths, which torch's broadcast matches against"
            )
        prefixed = [k.startswith(WRAPPER_PREFIX) for k in state_dict]
        if prefixed and not any(prefixed):
            state_dict = {WRAPPER_PREFIX + k: v for k, v in state_dict.items()}
        elif not all(prefixed):
            raise ValueError(
                "load_state_dict: some keys start with 'module.' and some do not; give all "
                "of them with the prefix or none"
            )
        return self.module.load_state_dict(state_dict, strict=strict, assign=assign)


class ParamAndGradBuffer:
    """What Megatron-Core's ``DistributedOptimizer`` calls on ``param_and_grad_buffer``."""

    def __init__(self, model: MegatronFSDP) -> None:
        self._model = model

    def copy_main_weights_to_model_weights(self) -> None:
        """After the optimizer step: the compute weights from the updated main weights."""
        self._model.install_optimized_model_weights()

    def zero_grad(self) -> None:
        self._model.zero_grad_buffer()

    def manual_buffer_registration(self) -> None:
        raise NotImplementedError(
            "param_and_grad_buffer.manual_buffer_registration: NCCL user-buffer registration "
            "(fsdp_manual_registration with nccl_ub) is not supported through the "
            "Megatron-Core adapter yet; leave fsdp_manual_registration False"
        )


def _refuse_unsupported_parallelism(
    config: Any, ddp_config: DistributedDataParallelConfig, module: nn.Module, pg_collection: Any
) -> None:
    """The ``TransformerConfig`` fields this adapter lacks a parallelism for, then the config's
    own, before any group is touched."""
    refuse_unsupported("mcore_config", config)
    ddp_config.refuse_unsupported()
    if not dist.is_initialized():
        raise RuntimeError(
            "FullyShardedDataParallel needs torch.distributed initialised "
            "(torch.distributed.init_process_group) before wrapping"
        )
    stages = int(getattr(config, "pipeline_model_parallel_size", 1) or 1)
    if stages > 1 and getattr(module, "share_embeddings_and_output_weights", False):
        raise NotImplementedError(
            f"config.pipeline_model_parallel_size={stages} with "
            "share_embeddings_and_output_weights=True is not supported yet: Megatron-Core "
            "all-reduces the first and last stages' copies of the word embedding shard by "
            "shard, and megatron-fsdp lays the two copies out in different units; untie them "
            "(GPTModel(share_embeddings_and_output_weights=False), Megatron-LM's "
            "--untie-embeddings-and-output-weights)"
        )


def _default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def _default_units(
    specs: Sequence[UnitSpec] | None, ddp_config: DistributedDataParallelConfig
) -> Sequence[UnitSpec]:
    """Megatron-Core's defaults: its layer classes (none under ``no_shard``)."""
    if specs is not None:
        return specs
    field = "ddp_config.data_parallel_sharding_strategy"
    strategy = parse_strategy(ddp_config.data_parallel_sharding_strategy, field)
    if strategy == ShardingStrategy.NO_SHARD:
        return []
    try:
        importlib.import_module("megatron.core")
    except ImportError:
        raise ValueError(
            "fsdp_unit_modules is required when megatron-core is not installed (its default "
            f"is Megatron-Core's {[spec.rpartition('.')[2] for spec in _MCORE_UNITS]})"
        ) from None
    found = []
    for spec in _MCORE_UNITS:
        path, _, name = spec.rpartition(".")
        with contextlib.suppress(ImportError, AttributeError):
            found.append(getattr(importlib.import_module(path), name))
    return found
