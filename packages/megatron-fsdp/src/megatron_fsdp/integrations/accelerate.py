"""``MegatronFSDPAccelerator``: Hugging Face ``accelerate`` over a model megatron-fsdp sharded.

A plain ``Accelerator`` wraps every trainable model in DDP unless accelerate runs FSDP
itself (GPUs only), so a model we sharded ends in DDP's ``_sync_module_states`` with a
reshape error (CPU) or in accelerate's "DTensor parameters ... device_map='auto'" (GPU).
This subclass prepares ours without DDP or a device move, unwraps the seed API's wrapper,
gathers ``get_state_dict`` on rank 0, and refuses ``save_state``/``load_state`` (accelerate
writes the optimizer from the main process only: one rank's shard).
"""

from __future__ import annotations

from typing import Any

import accelerate
import torch
from torch import nn

import mfsdp_checkpoint
from mfsdp_hooks import FSDPModule, FSDPRootWrapper

__all__ = ["MegatronFSDPAccelerator", "is_megatron_fsdp_model"]


def is_megatron_fsdp_model(model: nn.Module) -> bool:
    """True for a root wrapper of ours or a module the per-module ``fully_shard`` sharded."""
    return isinstance(model, (FSDPRootWrapper, FSDPModule))


class MegatronFSDPAccelerator(accelerate.Accelerator):  # type: ignore[misc]
    """An ``accelerate.Accelerator`` that prepares megatron-fsdp models without DDP; see the
    module docstring. Takes ``Accelerator``'s arguments."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.megatron_fsdp_models: list[nn.Module] = []
        """The megatron-fsdp models ``prepare_model`` has seen, in order."""

    @classmethod
    def adopting(cls, accelerator: accelerate.Accelerator) -> MegatronFSDPAccelerator:
        """This class over the state of an ``Accelerator`` built elsewhere (transformers'
        Trainer builds ``Accelerator`` by name). Accelerate keeps its process-wide state in
        shared singletons and the rest in the instance's attributes, which are carried over;
        call it before the accelerator prepares anything."""
        adopted = cls.__new__(cls)
        adopted.__dict__.update(vars(accelerator))
        adopted.megatron_fsdp_models = []
        return adopted

    def prepare_model(
        self,
        model: nn.Module,
        device_placement: bool | None = None,
        evaluation_mode: bool = False,
    ) -> nn.Module:
        if not is_megatron_fsdp_model(model):
            return super().prepare_model(model, device_placement, evaluation_mode)  # type: ignore[no-any-return]
        if all(model is not seen for seen in self.megatron_fsdp_models):
            self.megatron_fsdp_models.append(model)
        # evaluation_mode: autocast and compilation only, the preparation accelerate (and
        # transformers' Trainer) gives a model that was sharded before it was handed over.
        prepared: nn.Module = super().prepare_model(
            model, device_placement=False, evaluation_mode=True
        )
        return prepared

    def unwrap_model(
        self, model: nn.Module, keep_fp32_wrapper: bool = True, keep_torch_compile: bool = True
    ) -> nn.Module:
        unwrapped: nn.Module = super().unwrap_model(model, keep_fp32_wrapper, keep_torch_compile)
        if isinstance(unwrapped, FSDPRootWrapper):
            return unwrapped.module
        return unwrapped

    def get_state_dict(self, model: nn.Module, unwrap: bool = True) -> dict[str, torch.Tensor]:
        if not is_megatron_fsdp_model(model):
            return super().get_state_dict(model, unwrap)  # type: ignore[no-any-return]
        target = self.unwrap_model(model) if unwrap else model
        return mfsdp_checkpoint.gather_full_state_dict(target)

    def save_state(self, output_dir: str | None = None, *args: Any, **kwargs: Any) -> Any:
        self._refuse_sharded_state("save_state", "save_checkpoint(path, model, optimizer)")
        return super().save_state(output_dir, *args, **kwargs)

    def load_state(self, input_dir: str | None = None, *args: Any, **kwargs: Any) -> Any:
        self._refuse_sharded_state("load_state", "load_checkpoint(path, model, optimizer)")
        return super().load_state(input_dir, *args, **kwargs)

    def _refuse_sharded_state(self, method: str, ours: str) -> None:
        sharded = [type(m).__name__ for m in self.megatron_fsdp_models]
        if sharded:
            raise NotImplementedError(
                f"Accelerator.{method}: {', '.join(sharded)} is sharded by megatron-fsdp, and "
                "accelerate saves optimizer state from the main process only (one rank's "
                f"shard). Use mfsdp_checkpoint.{ours} on every rank: an atomic DCP "
                "checkpoint of the sharded model and optimizer that resumes at any world size"
            )
