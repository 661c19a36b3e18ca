"""mfsdp_te: FP8 parameters for megatron-fsdp (layer 4): codecs that claim tensor-subclass
weights for the engine (``fully_shard(param_codecs=...)``); status: the package README."""

import importlib.util

from mfsdp_hooks import ParamClassCodec
from mfsdp_te.float8_conversion import convert_for_float8_param_gather
from mfsdp_te.torchao_float8 import Float8GroupCodec, TorchaoFloat8Codec, torchao_float8_available

__version__ = "1.0.0"


def transformer_engine_available() -> bool:
    """Whether ``transformer_engine.pytorch`` can be imported here (never on CPU-only CI)."""
    return importlib.util.find_spec("transformer_engine") is not None


def float8_codecs() -> tuple[ParamClassCodec, ...]:
    """The codecs for every FP8 weight class this install can train (pass them to
    ``fully_shard(param_codecs=...)``; ``megatron_fsdp`` does)."""
    return (TorchaoFloat8Codec(),)


__all__ = [
    "Float8GroupCodec",
    "TorchaoFloat8Codec",
    "__version__",
    "convert_for_float8_param_gather",
    "float8_codecs",
    "torchao_float8_available",
    "transformer_engine_available",
]
