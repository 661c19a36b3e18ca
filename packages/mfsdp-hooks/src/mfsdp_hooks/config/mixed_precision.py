"""Mixed-precision policy: which dtype each copy of a parameter and its gradient lives in."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class MixedPrecisionPolicy:
    """Dtypes of the four copies FSDP keeps of a parameter.

    ``param_dtype``: dtype of the unsharded weights used for compute (and all-gathered);
    ``None`` keeps each parameter's own dtype.
    ``reduce_dtype``: dtype gradients are reduced in (``grad_reduce_in_fp32`` sets float32);
    ``None`` reduces in the compute dtype.
    ``main_params_dtype``: dtype of the sharded weights the optimizer steps on
    (``preserve_fp32_weights``); ``None`` lets the optimizer step on the compute weights.
    ``main_grads_dtype``: dtype of the accumulated gradient shard handed to the optimizer;
    ``None`` follows the optimizer-facing weights, as the optimizer requires.
    ``output_dtype``: cast floating-point forward outputs of the root to this dtype.
    ``cast_forward_inputs``: cast floating-point forward inputs to ``param_dtype``.
    ``use_decoupled_grad``: hand the reduced gradients to the optimizer in each parameter's
    ``decoupled_grad`` attribute instead of ``.grad`` (the reference's option, for optimizers
    that read it, e.g. Transformer Engine's ``FusedAdam(use_decoupled_grad=True)``); ``.grad``
    then stays None.
    """

    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    main_params_dtype: torch.dtype | None = torch.float32
    main_grads_dtype: torch.dtype | None = None
    output_dtype: torch.dtype | None = None
    cast_forward_inputs: bool = True
    use_decoupled_grad: bool = False

    def __post_init__(self) -> None:
        for name in ("param_dtype", "reduce_dtype", "main_params_dtype", "main_grads_dtype"):
            value = getattr(self, name)
            if value is not None and not (
                isinstance(value, torch.dtype) and value.is_floating_point
            ):
                raise TypeError(
                    f"MixedPrecisionPolicy.{name} must be a floating-point torch.dtype or None, "
                    f"got {value!r}"
                )

    @property
    def grad_attribute(self) -> str:
        """The parameter attribute that holds the reduced gradient the optimizer reads."""
        return "decoupled_grad" if self.use_decoupled_grad else "grad"

    def compute_dtype(self, original: torch.dtype) -> torch.dtype:
        return self.param_dtype or original

    def optimizer_dtype(self, original: torch.dtype) -> torch.dtype:
        """The dtype the optimizer sees: fp32 main weights, or the compute weights themselves."""
        return self.main_params_dtype or self.compute_dtype(original)

    def grad_reduce_dtype(self, original: torch.dtype) -> torch.dtype:
        return self.reduce_dtype or self.compute_dtype(original)

    def grad_dtype(self, original: torch.dtype) -> torch.dtype:
        return self.main_grads_dtype or self.optimizer_dtype(original)


def from_fsdp2_policy(policy: object) -> object:
    """torch FSDP2's ``MixedPrecisionPolicy`` as ours (same four fields, and ours keeps fp32
    main weights as FSDP2 keeps fp32 sharded parameters); anything else as it is."""
    from torch.distributed.fsdp import MixedPrecisionPolicy as FSDP2Policy

    if not isinstance(policy, FSDP2Policy):
        return policy
    return MixedPrecisionPolicy(
        param_dtype=policy.param_dtype,
        reduce_dtype=policy.reduce_dtype,
        output_dtype=policy.output_dtype,
        cast_forward_inputs=policy.cast_forward_inputs,
    )


def as_policy(policy: object, argument: str) -> MixedPrecisionPolicy:
    """``policy``, ours or torch FSDP2's (converted), as ours; else a ``TypeError``."""
    converted = from_fsdp2_policy(policy)
    if not isinstance(converted, MixedPrecisionPolicy):
        raise TypeError(
            f"{argument} must be an mfsdp_hooks.MixedPrecisionPolicy or torch FSDP2's, got "
            f"{type(policy).__name__}"
        )
    return converted
