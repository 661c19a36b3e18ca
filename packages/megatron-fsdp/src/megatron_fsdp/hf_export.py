"""``save_pretrained`` for a sharded Hugging Face model: a directory ``from_pretrained`` loads.

A sharded model's own ``save_pretrained`` would write each rank's shards under its FSDP class
name. Here the weights stream group by group into ``model.safetensors`` on rank 0 (no rank
holds the whole model), with ``config.json`` naming the model's own class. transformers is
not imported: the config objects are the model's.
"""

from __future__ import annotations

import copy
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule as TorchFSDPModule

from mfsdp_checkpoint import save_full_state_dict
from mfsdp_hooks import FSDPRootWrapper

__all__ = ["WEIGHTS_FILE", "model_class_of", "save_pretrained"]

WEIGHTS_FILE = "model.safetensors"
"""The file ``from_pretrained`` reads first (transformers' ``SAFE_WEIGHTS_NAME``)."""


def model_class_of(model: nn.Module) -> type[nn.Module]:
    """The class the model had before ``fully_shard`` mixed ``FSDPModule`` into it."""
    for cls in type(model).__mro__:
        if issubclass(cls, nn.Module) and not issubclass(cls, TorchFSDPModule):
            return cls
    raise AssertionError("unreachable: nn.Module is never an FSDPModule")


def save_pretrained(
    model: nn.Module, save_directory: str | Path, *, dtype: torch.dtype | None = None
) -> Path:
    """Write ``model`` (sharded by either API; a root wrapper is unwrapped) for
    ``from_pretrained``. Collective: call it on every rank. ``dtype`` casts floating weights
    (default: the main weights' dtype). Returns the directory."""
    hf_model = model.module if isinstance(model, FSDPRootWrapper) else model
    config = getattr(hf_model, "config", None)
    if config is None or not hasattr(config, "save_pretrained"):
        raise TypeError(
            f"save_pretrained: {model_class_of(hf_model).__name__} has no Hugging Face "
            ".config; for other models use mfsdp_checkpoint.save_full_state_dict(model, path)"
        )
    directory = Path(save_directory)
    save_full_state_dict(hf_model, directory / WEIGHTS_FILE, dtype=dtype)
    if not dist.is_initialized() or dist.get_rank() == 0:
        saved_config = copy.deepcopy(config)
        saved_config.architectures = [model_class_of(hf_model).__name__]
        saved_config.save_pretrained(directory)
        generation_config = getattr(hf_model, "generation_config", None)
        if generation_config is not None and hasattr(generation_config, "save_pretrained"):
            generation_config.save_pretrained(directory)
    return directory
