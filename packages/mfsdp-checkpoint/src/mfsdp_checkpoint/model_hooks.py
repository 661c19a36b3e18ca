"""``state_dict`` / ``load_state_dict`` hooks on every FSDP unit module (what each does: the
package README, "How data flows through it").

Hooks go on each unit's module (not only the root) so that any entry point is covered: the
``MegatronFSDP`` wrapper, its inner ``.module``, or a single block. Each unit's hooks handle the
parameters that unit owns, under whatever prefix torch passes in.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.utils.hooks import RemovableHandle

from mfsdp_checkpoint.chunks import annotate, chunk_of
from mfsdp_checkpoint.param_index import ParamIndex, ParamRef
from mfsdp_hooks import (
    FSDPUnit,
    ParameterGroup,
    RowShardedDTensor,
    dtensor_like,
    local_tensor,
    own_rows,
)

_HOOKS_ATTR = "_mfsdp_checkpoint_hooks"


def _same_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and (a.numel() == 0 or a.data_ptr() == b.data_ptr())


def torch_sharded(value: DTensor) -> bool:
    """A plain DTensor cut as its placements say (``torch.chunk``), not a replica."""
    return type(value) is DTensor and not all(p.is_replicate() for p in value.placements)


def coerce_for_load(value: Any, ref: ParamRef, key: str) -> Any:
    """Turn one incoming state-dict value into something ``param.copy_`` copies correctly: this
    rank's rows, as a DTensor laid out exactly like ``ref.param``."""
    target = ref.param
    if not isinstance(value, torch.Tensor) or not isinstance(target, DTensor):
        return value
    if tuple(value.shape) != tuple(target.shape):
        return value  # torch reports the size mismatch itself, naming the key
    if isinstance(value, DTensor):
        own = chunk_of(value)
        if own is not None:
            if own == ref.chunk:
                return value
        elif isinstance(target, RowShardedDTensor) and (
            isinstance(value, RowShardedDTensor) or torch_sharded(value)
        ):
            # Our rows already (the unit's own pre-hook ran), or torch's layout
            # (set_model_state_dict's distribute_tensor): gathered, our rows taken. Decided
            # from types and ranges alone, so every rank gathers the same tensors.
            return own_rows(value, target, key)
        elif _same_storage(local_tensor(value), local_tensor(target)):
            return value  # this very parameter, taken before the hooks were installed
        if all(p.is_replicate() for p in value.placements):
            return dtensor_like(ref.chunk.rows_of(local_tensor(value)), target)
        raise ValueError(
            f"load_state_dict: {key!r} is a DTensor with placements {value.placements} that do "
            "not match this model's sharding; load it through torch.distributed.checkpoint "
            "(which reshards), or pass a full tensor"
        )
    return dtensor_like(ref.chunk.rows_of(value), target)


class UnitCheckpointHooks:
    """The three hooks of one unit module, bound to the names that unit owns."""

    def __init__(self, unit: FSDPUnit) -> None:
        self.unit = unit
        self.index = ParamIndex(unit.module, groups=list(unit.groups))
        self.handles: list[RemovableHandle] = [
            # A partial, not a bound method: torch tags public state-dict hooks with an attribute.
            unit.module.register_state_dict_post_hook(  # type: ignore[no-untyped-call]
                functools.partial(UnitCheckpointHooks.after_state_dict, self)
            ),
            unit.module.register_load_state_dict_pre_hook(  # type: ignore[no-untyped-call]
                self.before_load
            ),
            unit.module.register_load_state_dict_post_hook(  # type: ignore[no-untyped-call]
                self.after_load
            ),
        ]

    def after_state_dict(
        self, module: nn.Module, state_dict: dict[str, Any], prefix: str, metadata: Any
    ) -> None:
        for name, ref in self.index.by_name.items():
            key = prefix + name
            if key in state_dict:  # the dist param, sharing its storage
                keep_vars = isinstance(state_dict[key], nn.Parameter)
                tensor = ref.param if keep_vars else ref.param.detach()
                state_dict[key] = annotate(tensor, ref.chunk, ref.group, ref.fqn)

    def before_load(
        self, module: nn.Module, state_dict: dict[str, Any], prefix: str, *_: Any
    ) -> None:
        for name, ref in self.index.by_name.items():
            key = prefix + name
            if key in state_dict:
                state_dict[key] = coerce_for_load(state_dict[key], ref, key)

    def after_load(self, module: nn.Module, incompatible: Any) -> None:
        mark_dirty(self.unit.groups)

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.unit.module.__dict__.pop(_HOOKS_ATTR, None)


def mark_dirty(groups: list[ParameterGroup]) -> None:
    """Make the engine re-install compute weights from the (just loaded) main weights."""
    for group in groups:
        group.mark_weights_dirty()


def install_unit_hooks(unit: FSDPUnit) -> UnitCheckpointHooks:
    """Install the hooks on ``unit`` once; later calls return the installed ones."""
    existing = unit.module.__dict__.get(_HOOKS_ATTR)
    if isinstance(existing, UnitCheckpointHooks):
        return existing
    hooks = UnitCheckpointHooks(unit)
    unit.module.__dict__[_HOOKS_ATTR] = hooks
    return hooks
