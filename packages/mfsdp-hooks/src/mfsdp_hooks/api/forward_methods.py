"""FSDP2's ``register_fsdp_forward_method``: another method of a unit runs as ``forward`` does.

A sharded module's hooks fire around ``forward`` only; a method such as ``generate`` that
reads the parameters without calling ``forward`` would see the sharded DTensors. Registering
it (the user's explicit request, for that one module instance) wraps it so that the unit
unshards before it and reshards after it, exactly as around ``forward``.
"""

from __future__ import annotations

import functools
from typing import Any

from torch import nn

from mfsdp_hooks.runtime.unit import unit_of, untraced

__all__ = ["register_fsdp_forward_method"]


def register_fsdp_forward_method(module: nn.Module, method_name: str) -> None:
    """Make ``module.<method_name>(...)`` run the unit's pre- and post-forward around it."""
    unit = unit_of(module)
    if unit is None:
        raise ValueError(
            f"register_fsdp_forward_method: {type(module).__name__} is not fully sharded; call "
            "fully_shard(module) first"
        )
    method = getattr(module, method_name, None)
    if not callable(method):
        raise ValueError(
            f"register_fsdp_forward_method: {type(module).__name__} has no method {method_name!r}"
        )

    pre_forward, post_forward = untraced(unit.pre_forward), untraced(unit.post_forward)

    @functools.wraps(method)
    def run_as_forward(*args: Any, **kwargs: Any) -> Any:
        args, kwargs = pre_forward(module, args, kwargs)
        return post_forward(module, args, method(*args, **kwargs))

    setattr(module, method_name, run_as_forward)
