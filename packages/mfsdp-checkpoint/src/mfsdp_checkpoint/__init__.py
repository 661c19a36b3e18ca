"""mfsdp_checkpoint: DTensor state dicts, DCP save/load, resharding and conversion (layer 4).

The layer is being built: today the sharded model's ``state_dict()`` already holds DTensors
(from mfsdp_hooks); save/load helpers, resharding, conversion and atomic saves come next.
"""

__version__ = "0.1.0"

__all__ = ["__version__"]
