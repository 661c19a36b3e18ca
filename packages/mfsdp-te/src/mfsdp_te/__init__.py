"""mfsdp_te: FP8 parameters for megatron-fsdp (layer 4).

With Transformer Engine installed this will wrap TE's quantized tensors; without it, native
torch ``float8_e4m3fn``/``float8_e5m2`` with per-tensor scales. Not implemented yet.
"""

import importlib.util

__version__ = "0.1.0"


def transformer_engine_available() -> bool:
    """Whether ``transformer_engine.pytorch`` can be imported here (never on CPU-only CI)."""
    return importlib.util.find_spec("transformer_engine") is not None


__all__ = ["__version__", "transformer_engine_available"]
