"""mfsdp_checkpoint: distributed checkpoints of sharded models (layer 4 of megatron-fsdp).

* ``enable_dcp(model, optimizer)``: ``state_dict()`` of the sharded model and optimizer hold
  DTensors of the original shapes with their true (uneven) row ranges (the optimizer's in
  torch's positional format, which torch's ``get_optimizer_state_dict`` keys by name), so
  ``torch.distributed.checkpoint.save/load`` work directly, across world sizes and sharding
  strategies, and with torch FSDP2 checkpoints.
* ``save``/``load`` (any DCP state dict) and ``save_checkpoint``/``load_checkpoint`` (model +
  optimizer): atomic directories with a completion marker and checksums; clear errors raised on
  every rank. ``async_save``/``async_save_checkpoint``: the same checkpoints written in the
  background while training goes on.
* ``gather_full_state_dict``/``save_full_state_dict``: the unsharded model on rank 0, streamed
  group by group; ``load_full_state_dict``: a single-process state dict into a sharded model
  without any rank holding it whole.
* ``convert``/``describe`` and the ``mfsdp-checkpoint`` command line: DCP <-> torch <->
  safetensors, with prefix stripping for Hugging Face.
* Megatron's checkpoint names, for the Megatron-Core adapter above: ``WRAPPER_PREFIX`` and
  ``split_wrappers`` (the ``module.`` levels before a model's own path), ``is_swiglu_key``,
  ``swiglu_halves`` and ``split_rows`` (a SwiGLU ``linear_fc1`` saved as its two halves),
  ``has_row_chunk`` and ``to_megatron_optimizer_state`` (the ``fsdp_dtensor`` optimizer section).
"""

from mfsdp_checkpoint.async_checkpoint import CheckpointStager, async_save, async_save_checkpoint
from mfsdp_checkpoint.atomic import load, read_metadata, save
from mfsdp_checkpoint.checkpoint import load_checkpoint, save_checkpoint
from mfsdp_checkpoint.chunks import has_row_chunk, split_rows
from mfsdp_checkpoint.convert import convert, describe
from mfsdp_checkpoint.enable import DCPHandle, enable_dcp, named_optimizer_state_dict
from mfsdp_checkpoint.errors import (
    CheckpointError,
    CheckpointNotFoundError,
    CorruptCheckpointError,
    IncompleteCheckpointError,
    StateDictMismatchError,
)
from mfsdp_checkpoint.full_gather import gather_full_state_dict, save_full_state_dict
from mfsdp_checkpoint.full_load import FullLoadResult, load_full_state_dict
from mfsdp_checkpoint.megatron_optim import (
    is_swiglu_key,
    swiglu_halves,
    to_megatron_optimizer_state,
)
from mfsdp_checkpoint.wrapper_prefix import WRAPPER_PREFIX, split_wrappers

__version__ = "1.0.0"

__all__ = [
    "CheckpointError",
    "CheckpointStager",
    "CheckpointNotFoundError",
    "CorruptCheckpointError",
    "DCPHandle",
    "FullLoadResult",
    "IncompleteCheckpointError",
    "StateDictMismatchError",
    "WRAPPER_PREFIX",
    "__version__",
    "async_save",
    "async_save_checkpoint",
    "convert",
    "describe",
    "enable_dcp",
    "named_optimizer_state_dict",
    "gather_full_state_dict",
    "has_row_chunk",
    "is_swiglu_key",
    "load",
    "load_checkpoint",
    "load_full_state_dict",
    "read_metadata",
    "save",
    "save_checkpoint",
    "save_full_state_dict",
    "split_rows",
    "split_wrappers",
    "swiglu_halves",
    "to_megatron_optimizer_state",
]
