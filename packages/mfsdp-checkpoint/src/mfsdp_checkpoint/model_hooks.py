"""``state_dict`` / ``load_state_dict`` hooks on every FSDP unit module.

Hooks go on each unit's module (not only the root) so that any entry point is covered: the
``MegatronFSDP`` wrapper, its inner ``.module``, or a single block. Each unit's hooks handle the
parameters that unit owns, under whatever prefix torch passes in.

* After ``state_dict()``: each owned entry becomes a detached DTensor view of the dist param
  (fp32 main weights, this rank's true rows, no copy) carrying the DCP protocol methods; that is
  what lets ``torch.distributed.checkpoint.save/load`` handle it directly.
* Before ``load_state_dict()``: full tensors and replicated DTensors are cut to this rank's rows,
  so torch's own ``param.copy_(value)`` is a local copy; other layouts are refused clearly.
* After ``load_state_dict()``: the unit's groups are marked dirty so the engine re-installs its
  compute weights (bf16 copies, replicated buffers) at the next unshard.
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


def dcp_view(ref: ParamRef, keep_vars: bool = False) -> torch.Tensor:
    """The state-dict value of one dist param: an annotated DTensor sharing its storage."""
    tensor = ref.param if keep_vars else ref.param.detach()
    return annotate(tensor, ref.chunk, ref.group, ref.fqn)


def _as_local_rows(value: torch.Tensor, ref: ParamRef) -> torch.Tensor:
    """A DTensor laid out exactly like ``ref.param`` holding ``value``'s rows for this rank."""
    target = ref.param
    assert isinstance(target, DTensor)
    chunk = ref.chunk
    rows = chunk.rows_of(value)
    return dtensor_like(rows, target)


def _same_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and (a.numel() == 0 or a.data_ptr() == b.data_ptr())


def _row_or_torch_sharded(value: DTensor) -> bool:
    """Row-sharded, or a plain DTensor cut as its placements say (``torch.chunk``), not a
    replica."""
    if isinstance(value, RowShardedDTensor):
        return True
    return type(value) is DTensor and not all(p.is_replicate() for p in value.placements)


def coerce_for_load(value: Any, ref: ParamRef, key: str) -> Any:
    """Turn one incoming state-dict value into something ``param.copy_`` copies correctly."""
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
        elif isinstance(target, RowShardedDTensor) and _row_or_torch_sharded(value):
            # Our rows already (the unit's own pre-hook ran), or torch's layout
            # (set_model_state_dict's distribute_tensor): gathered, our rows taken. Decided
            # from types and ranges alone, so every rank gathers the same tensors.
            return own_rows(value, target, key)
        elif _same_storage(local_tensor(value), local_tensor(target)):
            return value  # this very parameter, taken before the hooks were installed
        if all(p.is_replicate() for p in value.placements):
            return _as_local_rows(local_tensor(value), ref)
        raise ValueError(
            f"load_state_dict: {key!r} is a DTensor with placements {value.placements} that do "
            "not match this model's sharding; load it through torch.distributed.checkpoint "
            "(which reshards), or pass a full tensor"
        )
    return _as_local_rows(value, ref)


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
            if key in state_dict:
                keep_vars = isinstance(state_dict[key], nn.Parameter)
                state_dict[key] = dcp_view(ref, keep_vars=keep_vars)

    def before_load(
        self,
        module: nn.Module,
        state_dict: dict[str, Any],
        prefix: str,
        metadata: Any,
        strict: bool,
        missing: list[str],
        unexpected: list[str],
        errors: list[str],
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
