"""``fp8_param_gather=True`` on CPU-capable float8: a model's Linear layers as torchao's
``Float8Linear`` with float8 all-gather weights (tensorwise scaling), before it is sharded.

The reference's config field gathers Transformer Engine's FP8 parameters in FP8; where
Transformer Engine cannot run, torchao's float8 training does the same (each converted
weight travels as one byte per element, :mod:`mfsdp_te.torchao_float8` claims it).
"""

from __future__ import annotations

from torch import nn

__all__ = ["FLOAT8_DIM_MULTIPLE", "convert_for_float8_param_gather"]

FLOAT8_DIM_MULTIPLE = 16
"""Float8 matmuls (``torch._scaled_mm``) need both dims of a weight to be multiples of 16."""


def _float8_dims(module: nn.Linear) -> bool:
    return (
        module.in_features % FLOAT8_DIM_MULTIPLE == 0
        and module.out_features % FLOAT8_DIM_MULTIPLE == 0
    )


def convert_for_float8_param_gather(module: nn.Module, argument: str) -> list[str]:
    """Convert ``module``'s eligible ``nn.Linear`` layers in place (both dims multiples of
    16; others stay in high precision) and return the float8 layers' names. ``argument``
    names the setting in errors. Raises when torchao is missing, when a layer was converted
    without float8 all-gather, or when no layer can be float8."""
    try:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training
        from torchao.float8.float8_linear import Float8Linear
    except ImportError as error:
        raise ImportError(
            f"{argument}=True gathers weights in float8 through torchao's float8 training, "
            "which is not installed: pip install torchao (or leave it False)"
        ) from error
    for name, sub in module.named_modules():
        if isinstance(sub, Float8Linear) and not sub.config.enable_fsdp_float8_all_gather:
            raise ValueError(
                f"{argument}=True, but {name!r} is a torchao Float8Linear converted without "
                "float8 all-gather: convert with Float8LinearConfig("
                "enable_fsdp_float8_all_gather=True), or leave the model unconverted"
            )
    config = Float8LinearConfig(enable_fsdp_float8_all_gather=True)
    convert_to_float8_training(
        module,
        config=config,
        # Float8Linear is an nn.Linear too: converted layers are kept, not converted again.
        module_filter_fn=lambda m, _: (
            isinstance(m, nn.Linear) and not isinstance(m, Float8Linear) and _float8_dims(m)
        ),
    )
    converted = [n for n, m in module.named_modules() if isinstance(m, Float8Linear)]
    if not converted:
        raise ValueError(
            f"{argument}=True, but {type(module).__name__} has no nn.Linear whose dims are "
            f"both multiples of {FLOAT8_DIM_MULTIPLE} (what float8 matmuls need): nothing "
            "would be gathered in float8; leave it False"
        )
    return converted
