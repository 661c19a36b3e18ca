"""Public lookups from parameters to the engine objects that own them.

Upper layers (checkpoints, FP8) go through these instead of private attributes.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch
from torch import nn

from mfsdp_hooks.dtensor.row_sharded import RowShardedDTensor
from mfsdp_hooks.weights.param_group import ParameterGroup

_GROUP_ATTR = "_mfsdp_group"
_INDEX_ATTR = "_mfsdp_index"
_DIST_ATTR = "_mfsdp_dist_param"
_MODEL_ATTR = "_mfsdp_model_ref"
_OWNER_ATTR = "_mfsdp_owner"
_MATERIALIZED_ATTR = "_mfsdp_materialized_as"
_META_ATTR = "_mfsdp_materialized_from"


@dataclass(frozen=True)
class ParamLocation:
    """Where a distributed parameter lives: its group and its index in that group."""

    group: ParameterGroup
    index: int

    @property
    def dist_param(self) -> nn.Parameter:
        return self.group.dist_params[self.index]


def register_group_params(group: ParameterGroup) -> None:
    """Tag a group's parameters once, at wrap time, so lookups cost one attribute read."""
    for index, (dist_param, unsharded) in enumerate(
        zip(group.dist_params, group.unsharded_params, strict=True)
    ):
        setattr(dist_param, _GROUP_ATTR, group)
        setattr(dist_param, _INDEX_ATTR, index)
        if isinstance(dist_param, RowShardedDTensor):  # dcp.load writes it in place
            dist_param.on_checkpoint_load = group.mark_weights_dirty
        setattr(unsharded, _DIST_ATTR, dist_param)


def register_replaced(original: nn.Parameter, dist_param: nn.Parameter, owner: str) -> None:
    """Tag a user's original parameter with its sharded replacement and the unit that owns
    it: an optimizer built before sharding is re-pointed through the tag, and a module
    outside the unit that still holds the original (a tied weight) is refused by it.

    An original meta init made takes its tags to its meta parameter too, which then lets go
    of it: an optimizer built on the meta model holds the meta parameters, and through them
    it would keep every materialised full tensor (the whole model) alive."""
    meta = getattr(original, _META_ATTR, None)
    for tagged in (original, meta) if isinstance(meta, torch.Tensor) else (original,):
        setattr(tagged, _DIST_ATTR, dist_param)
        setattr(tagged, _OWNER_ATTR, owner)
    if isinstance(meta, torch.Tensor) and getattr(meta, _MATERIALIZED_ATTR, None) is original:
        delattr(meta, _MATERIALIZED_ATTR)


def register_materialized(meta: torch.Tensor, real: torch.Tensor) -> None:
    """Tag a meta-device parameter with the real one meta init made for it, so an optimizer
    built on the meta model is re-pointed (through it) at the sharded replacement; once
    ``real`` is replaced, ``register_replaced`` moves the tags onto ``meta`` itself."""
    setattr(meta, _MATERIALIZED_ATTR, real)
    setattr(real, _META_ATTR, meta)  # a meta tensor holds no memory


def _materialized(param: torch.Tensor) -> torch.Tensor:
    real = getattr(param, _MATERIALIZED_ATTR, None)
    return real if isinstance(real, torch.Tensor) else param


def replaced_by_unit(param: torch.Tensor) -> str | None:
    """The unit that replaced ``param`` (an original parameter), or None."""
    owner = getattr(_materialized(param), _OWNER_ATTR, None)
    return owner if isinstance(owner, str) else None


def tied_to_other_unit(name: str, user: str, owner: str) -> ValueError:
    """The refusal of parameter ``name`` of ``user`` that the unit ``owner`` already shards (a
    tie across units). FSDP2 raises a ValueError with "already managed by another" for it:
    code and tests that match those words keep working with ours."""
    return ValueError(
        f"parameter {name!r} of {user} is shared with the FSDP unit {owner}: it is already "
        "managed by another FSDP unit, and tied parameters must live in one unit; "
        "fully_shard their common parent module, or the modules together in one call "
        "(fully_shard([a, b])), instead of each user"
    )


def dist_param_of(param: torch.Tensor) -> nn.Parameter | None:
    """The distributed parameter behind ``param``: itself, its unsharded compute twin, the
    original it replaced, or a meta parameter materialised into such an original."""
    param = _materialized(param)
    twin = getattr(param, _DIST_ATTR, None)
    if isinstance(twin, nn.Parameter):
        return twin
    if isinstance(param, nn.Parameter) and isinstance(
        getattr(param, _GROUP_ATTR, None), ParameterGroup
    ):
        return param
    return None


def locate(param: torch.Tensor) -> ParamLocation | None:
    """Group and index of a distributed or unsharded parameter; None for anything else."""
    dist_param = dist_param_of(param)
    if dist_param is None:
        return None
    group = getattr(dist_param, _GROUP_ATTR)
    index = getattr(dist_param, _INDEX_ATTR)
    assert isinstance(group, ParameterGroup) and isinstance(index, int)
    return ParamLocation(group, index)


def set_owning_model(group: ParameterGroup, model: nn.Module) -> None:
    """Remember the outermost wrapped module, whose names the state dicts use."""
    setattr(group, _MODEL_ATTR, weakref.ref(model))


def owning_model(group: ParameterGroup) -> nn.Module | None:
    """The outermost module wrapped around ``group`` so far (None once it is gone)."""
    ref = getattr(group, _MODEL_ATTR, None)
    return ref() if ref is not None else None


def optimizer_grad(param: torch.Tensor) -> torch.Tensor | None:
    """The reduced gradient the optimizer reads for ``param``: its ``.grad``, or its
    ``decoupled_grad`` when its group was built with ``use_decoupled_grad`` (grad-norm and
    clipping code reads gradients through this, whichever attribute holds them)."""
    location = locate(param)
    if location is None or location.group.grads is None:
        return param.grad
    return location.group.grads.held(location.dist_param)
