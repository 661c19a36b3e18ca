"""``MegatronFSDPTrainer``: ``transformers.Trainer`` training a model sharded by megatron-fsdp.

What it changes in ``Trainer``, and why: the package README, "Hugging Face". In short: it
shards in ``__init__``, adopts Trainer's accelerator into a ``MegatronFSDPAccelerator`` (no
DDP), and overrides four private methods because Trainer saves the optimizer from rank 0
only and loads weights as full tensors.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

import torch
import transformers
from torch import nn
from transformers.trainer import SCHEDULER_NAME, TRAINING_ARGS_NAME

import mfsdp_checkpoint
from megatron_fsdp.api import fully_shard_model, fully_shard_optimizer
from megatron_fsdp.hf_export import WEIGHTS_FILE, save_pretrained
from megatron_fsdp.integrations.accelerate import MegatronFSDPAccelerator, is_megatron_fsdp_model
from mfsdp_hooks import (
    FSDPOptimizer,
    FSDPRootWrapper,
    MixedPrecisionPolicy,
    UnitSpec,
    resolve_unit_modules,
)
from mfsdp_hooks import fully_shard as fully_shard_module

__all__ = [
    "CHECKPOINT_SUBDIR",
    "MegatronFSDPConfig",
    "MegatronFSDPTrainer",
    "shard_for_trainer",
    "unit_classes",
]

CHECKPOINT_SUBDIR = "megatron_fsdp"
"""Where in Trainer's ``checkpoint-N`` folder the sharded model and optimizer are saved."""


@dataclasses.dataclass(frozen=True)
class MegatronFSDPConfig:
    """How ``MegatronFSDPTrainer`` shards the model.

    Args:
        api: ``"seed"`` (``fully_shard_model`` + ``fully_shard_optimizer``) or
            ``"per_module"`` (``mfsdp_hooks.fully_shard`` on each unit, then the root).
        fsdp_unit_modules: the unit classes (or import paths). None: the training
            arguments' ``fsdp_config["transformer_layer_cls_to_wrap"]``, else the model's
            ``_no_split_modules``.
        zero_dp_strategy: 0-3 or its name (``fully_shard_model``'s; the per-module API's
            ``sharding_strategy``).
        mixed_precision_policy: ``megatron_fsdp.MixedPrecisionPolicy`` (the per-module API's
            ``mp_policy``). For autocast, use ``TrainingArguments(bf16=True)`` instead.
        options: further keyword arguments of ``fully_shard_model`` (seed) or of
            ``mfsdp_hooks.fully_shard`` (per-module), checked by them.
    """

    api: Literal["seed", "per_module"] = "seed"
    fsdp_unit_modules: Sequence[UnitSpec] | None = None
    zero_dp_strategy: int | str = 3
    mixed_precision_policy: MixedPrecisionPolicy | None = None
    options: dict[str, Any] = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.api not in ("seed", "per_module"):
            raise ValueError(
                f"MegatronFSDPConfig.api must be 'seed' or 'per_module', got {self.api!r}"
            )


def unit_classes(
    model: nn.Module, config: MegatronFSDPConfig, args: transformers.TrainingArguments
) -> list[UnitSpec]:
    """The FSDP units: ``config.fsdp_unit_modules``, else the class names in
    ``args.fsdp_config["transformer_layer_cls_to_wrap"]``, else the model's
    ``_no_split_modules``; names are matched against the model's own modules."""
    if config.fsdp_unit_modules is not None:
        return list(config.fsdp_unit_modules)
    fsdp_config = args.fsdp_config if isinstance(args.fsdp_config, dict) else {}
    from_args = fsdp_config.get("transformer_layer_cls_to_wrap")
    names: list[str] = list(from_args) if from_args else []
    if not names:
        names = list(getattr(model, "_no_split_modules", None) or [])
    if not names:
        raise ValueError(
            f"MegatronFSDPConfig.fsdp_unit_modules: {type(model).__name__} names no blocks "
            "(no fsdp_config['transformer_layer_cls_to_wrap'], no _no_split_modules); give the "
            "class of its repeated layers, e.g. fsdp_unit_modules=[LlamaDecoderLayer]"
        )
    by_name = {type(m).__name__: type(m) for m in model.modules()}
    missing = [n for n in names if n not in by_name]
    if missing and len(missing) == len(names):
        raise ValueError(
            f"MegatronFSDPConfig.fsdp_unit_modules: no module of {type(model).__name__} is a "
            f"{', '.join(missing)}; give the class of its repeated layers"
        )
    return [by_name[n] for n in names if n in by_name]


def shard_for_trainer(
    model: nn.Module, config: MegatronFSDPConfig, args: transformers.TrainingArguments
) -> tuple[nn.Module, FSDPRootWrapper | None]:
    """Shard ``model`` in place as ``config`` says. Returns (the model, now the FSDP root;
    the seed API's root wrapper, or None for the per-module API)."""
    units = unit_classes(model, config, args)
    if config.api == "seed":
        wrapper = fully_shard_model(
            model,
            fsdp_unit_modules=units,
            zero_dp_strategy=config.zero_dp_strategy,
            mixed_precision_policy=config.mixed_precision_policy,
            **config.options,
        )
        return wrapper.module, wrapper
    classes = resolve_unit_modules(units)
    blocks = [m for m in model.modules() if isinstance(m, classes) and m is not model]
    kwargs = dict(config.options)
    kwargs.setdefault("sharding_strategy", config.zero_dp_strategy)
    kwargs.setdefault("mp_policy", config.mixed_precision_policy)
    for block in blocks:
        fully_shard_module(block, **kwargs)
    fully_shard_module(model, **kwargs)
    return model, None


class MegatronFSDPTrainer(transformers.Trainer):
    """``transformers.Trainer`` over megatron-fsdp: ``Trainer``'s arguments (by keyword after
    ``model`` and ``args``) plus ``megatron_fsdp`` (None: ``MegatronFSDPConfig()``, ZeRO-3)."""

    def __init__(
        self,
        model: nn.Module | None = None,
        args: transformers.TrainingArguments | None = None,
        *,
        megatron_fsdp: MegatronFSDPConfig | None = None,
        **trainer_kwargs: Any,
    ) -> None:
        if model is None or args is None:
            raise ValueError(
                "MegatronFSDPTrainer needs model= and args= (model_init is not supported: "
                "the model is sharded once, here)"
            )
        if args.fsdp:
            raise ValueError(
                f"TrainingArguments.fsdp={args.fsdp!r} asks accelerate for torch FSDP; "
                "MegatronFSDPTrainer shards the model itself. Leave fsdp unset and choose the "
                "strategy with megatron_fsdp=MegatronFSDPConfig(zero_dp_strategy=...)"
            )
        _ = args.device  # initialises the process group from torchrun's environment
        self.megatron_fsdp_wrapper: FSDPRootWrapper | None = None
        """The seed API's root wrapper (None for the per-module API)."""
        if isinstance(model, FSDPRootWrapper):
            _refuse_config_for_sharded(megatron_fsdp)
            self.megatron_fsdp_wrapper, model = model, model.module
        elif is_megatron_fsdp_model(model):
            _refuse_config_for_sharded(megatron_fsdp)
        else:
            config = megatron_fsdp or MegatronFSDPConfig()
            optimizer = _user_optimizer(trainer_kwargs)
            if optimizer is not None and config.api == "per_module":
                raise ValueError(
                    "optimizers: with MegatronFSDPConfig(api='per_module') build the optimizer "
                    "after sharding (as FSDP2 wants), or leave it to the Trainer "
                    "(optimizer_cls_and_kwargs=...)"
                )
            model, self.megatron_fsdp_wrapper = shard_for_trainer(model, config, args)
            if optimizer is not None:
                fully_shard_optimizer(optimizer)  # re-pointed at the sharded parameters
        super().__init__(model, args, **trainer_kwargs)

    # ------------------------------------------------------------------ accelerator
    def create_accelerator_and_postprocess(self) -> None:
        super().create_accelerator_and_postprocess()
        # Trainer's gather_function stays bound to the accelerator it built: gathering reads
        # accelerate's shared state only, the same through either object.
        self.accelerator = MegatronFSDPAccelerator.adopting(self.accelerator)

    # ------------------------------------------------------------------ optimizer
    def create_optimizer(self, model: nn.Module | None = None) -> torch.optim.Optimizer:
        optimizer: torch.optim.Optimizer = super().create_optimizer(model)
        if self.megatron_fsdp_wrapper is not None and not isinstance(optimizer, FSDPOptimizer):
            self.optimizer = optimizer = fully_shard_optimizer(optimizer)
        return optimizer

    def _root(self) -> nn.Module:
        """The model Trainer trains: the Hugging Face model, now the FSDP root unit."""
        assert self.model is not None
        return self.model

    def _sharded_optimizer(self) -> torch.optim.Optimizer:
        """The optimizer under accelerate's ``AcceleratedOptimizer`` (its public
        ``.optimizer``), whose ``state_dict`` is DCP-ready."""
        optimizer = self.optimizer
        inner = getattr(optimizer, "optimizer", optimizer)
        assert isinstance(inner, torch.optim.Optimizer)
        return inner

    # ------------------------------------------------------------------ saving
    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """``config.json`` + ``model.safetensors`` that ``from_pretrained`` loads. Collective:
        call it on every rank (Trainer does)."""
        directory = Path(output_dir if output_dir is not None else str(self.args.output_dir))
        save_pretrained(self._root(), directory)
        if self.args.should_save:
            if self.processing_class is not None:
                self.processing_class.save_pretrained(directory)
            torch.save(self.args, directory / TRAINING_ARGS_NAME)
        if self.args.push_to_hub and not _internal_call:
            self.push_to_hub(commit_message="Model save", revision=self.args.hub_revision)

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        # Overridden (private in Trainer): Trainer torch.saves rank 0's optimizer shard only.
        mfsdp_checkpoint.save_checkpoint(
            Path(output_dir) / CHECKPOINT_SUBDIR, self._root(), self._sharded_optimizer()
        )
        if self.args.should_save and self.lr_scheduler is not None:
            torch.save(self.lr_scheduler.state_dict(), os.path.join(output_dir, SCHEDULER_NAME))

    # ------------------------------------------------------------------ resuming
    def _load_from_checkpoint(
        self, resume_from_checkpoint: str, model: nn.Module | None = None
    ) -> None:
        # Overridden (private in Trainer): Trainer would load full tensors into our shards.
        _load_weights(self._root(), resume_from_checkpoint)

    def _load_best_model(self) -> None:
        # Overridden (private in Trainer), for load_best_model_at_end: as above.
        assert self.state.best_model_checkpoint is not None
        _load_weights(self._root(), self.state.best_model_checkpoint)

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        # Overridden (private in Trainer): the optimizer comes from our DCP checkpoint.
        # The weights were loaded by _load_from_checkpoint, before the optimizer existed.
        if checkpoint is None:
            return
        mfsdp_checkpoint.load_checkpoint(
            _checkpoint_dir(checkpoint), self._root(), self._sharded_optimizer(), weights=False
        )
        scheduler_file = os.path.join(checkpoint, SCHEDULER_NAME)
        if self.lr_scheduler is not None and os.path.isfile(scheduler_file):
            self.lr_scheduler.load_state_dict(torch.load(scheduler_file, weights_only=True))


def _load_weights(model: nn.Module, checkpoint: str) -> None:
    """The weights of a ``checkpoint-N`` folder: our DCP checkpoint, or, where there is none
    (``save_only_model=True``, a plain Trainer's folder), its ``model.safetensors``, read
    into the shards without any rank holding the whole model."""
    directory = Path(checkpoint) / CHECKPOINT_SUBDIR
    if directory.is_dir():
        mfsdp_checkpoint.load_checkpoint(directory, model)
        return
    weights = Path(checkpoint) / WEIGHTS_FILE
    if not weights.is_file():
        raise FileNotFoundError(
            f"{checkpoint!r} has neither {CHECKPOINT_SUBDIR}/ nor {WEIGHTS_FILE}: it is not a "
            "checkpoint folder of a Trainer"
        )
    mfsdp_checkpoint.load_full_state_dict(model, weights)


def _checkpoint_dir(checkpoint: str) -> Path:
    directory = Path(checkpoint) / CHECKPOINT_SUBDIR
    if not directory.is_dir():
        raise FileNotFoundError(
            f"resume_from_checkpoint={checkpoint!r} has no {CHECKPOINT_SUBDIR}/ folder, so no "
            "optimizer state: it was not written by MegatronFSDPTrainer (or with "
            "save_only_model=True). To start from its weights alone, load them with "
            "from_pretrained before sharding"
        )
    return directory


def _refuse_config_for_sharded(config: MegatronFSDPConfig | None) -> None:
    if config is not None:
        raise ValueError(
            "megatron_fsdp: the model is sharded already; leave megatron_fsdp=None (its "
            "sharding stays as it was made)"
        )


def _user_optimizer(kwargs: dict[str, Any]) -> torch.optim.Optimizer | None:
    optimizers = kwargs.get("optimizers")
    if not optimizers:
        return None
    optimizer = optimizers[0]
    return optimizer if isinstance(optimizer, torch.optim.Optimizer) else None
