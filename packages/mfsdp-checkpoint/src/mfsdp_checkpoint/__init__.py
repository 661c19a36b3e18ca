"""mfsdp_checkpoint: distributed checkpoints of sharded models (layer 4 of megatron-fsdp).

What the public functions do (``convert``/``describe``: its "Command line") and how data flows
through the modules: the package README. The Megatron names (``WRAPPER_PREFIX`` ...
``to_megatron_optimizer_state``, each documented where it is defined) serve the Megatron-Core
adapter above.
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
