"""``mixed_precision_context``: another mixed-precision policy for a region of the program
(``mfsdp_hooks.runtime.compute_region`` says what may change and how)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from torch import nn

from mfsdp_hooks.config.mixed_precision import MixedPrecisionPolicy, from_fsdp2_policy
from mfsdp_hooks.runtime.compute_region import enter_region, leave_region
from mfsdp_hooks.runtime.unit import units_under

__all__ = ["mixed_precision_context", "wrap_time_policy"]


def _units(module: nn.Module) -> list[Any]:
    units = units_under(module.modules())
    if not units:
        raise ValueError(
            f"mixed_precision_context: {type(module).__name__} is not fully sharded; wrap it "
            "first (fully_shard_model, MegatronFSDP or fully_shard)"
        )
    return units


def wrap_time_policy(module: nn.Module) -> MixedPrecisionPolicy:
    """The policy ``module``'s units were wrapped with (its root unit's)."""
    units = _units(module)
    return units[-1].options.policy  # type: ignore[no-any-return]


@contextlib.contextmanager
def mixed_precision_context(module: nn.Module, policy: Any) -> Iterator[None]:
    """Every unit under ``module`` follows ``policy`` (ours, or torch FSDP2's) inside, the
    wrap-time policy again after, even when the region raises. Enter and leave between
    steps; regions do not nest."""
    converted = from_fsdp2_policy(policy)
    if not isinstance(converted, MixedPrecisionPolicy):
        raise TypeError(
            "mixed_precision_context: policy must be a megatron_fsdp.MixedPrecisionPolicy (or "
            f"torch FSDP2's), got {type(policy).__name__}"
        )
    units = _units(module)
    enter_region(units, converted)
    try:
        yield
    finally:
        leave_region(units)
