"""``model.to(torch.float64)``, ``.double()``, ``.to(torch.bfloat16)`` after sharding: the
sharded parameters convert, as FSDP2's (``module_conversion`` calls this; the storage side is
``weights.group_dtype``).

[Note: dtypes after a conversion] The conversion acts on what FSDP2 converts: the sharded
parameters the optimizer steps (ours: the main weights, or the compute weights where they are
the same). The user's dtype of the group (``original_dtype``) follows it, and the unit's
mixed-precision policy is applied to it as at wrap time, as FSDP2's ``init_dtype_attrs``
does: a policy ``param_dtype`` (bf16) keeps the compute in bf16 under ``.double()`` (float64
shards, gradients and optimizer state, bf16 gathers), and ``.to(torch.bfloat16)`` with it
leaves one bf16 copy (no main weights). Without ``param_dtype`` the compute follows the
conversion: ``.to(torch.bfloat16)`` is pure-bf16 training.

Refused, on every rank alike, before anything changes (``NotImplementedError`` naming the
fix): a conversion of part of a unit, what ``_why_not`` lists, and one while an optimizer
holds state for the parameters (torch's optimizers make it lazily, so one built before the
conversion and not yet stepped is fine, as the parameters keep their identity).
"""

from __future__ import annotations

import gc
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from mfsdp_hooks.config.codec import IDENTITY
from mfsdp_hooks.runtime.training_state import TrainingState
from mfsdp_hooks.runtime.unit import FSDPUnit, units_under
from mfsdp_hooks.weights.group_dtype import convert_group_dtype
from mfsdp_hooks.weights.lookup import locate
from mfsdp_hooks.weights.param_group import ParameterGroup

__all__ = ["convert_managed_dtypes"]

Conversion = Callable[[torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class _Plan:
    unit: FSDPUnit
    group: ParameterGroup
    original: torch.dtype
    compute: torch.dtype
    optimizer: torch.dtype
    reduce: torch.dtype


def _converted(fn: Conversion, dtype: torch.dtype, device: torch.device) -> torch.dtype:
    with torch.no_grad():
        return fn(torch.empty(0, dtype=dtype, device=device)).dtype


def _plan(unit: FSDPUnit, group: ParameterGroup, fn: Conversion) -> _Plan | None:
    device = group.topology.device
    optimizer = _converted(fn, group.dist_params[0].dtype, device)
    original = _converted(fn, group.original_dtype, device)
    if optimizer == group.dist_params[0].dtype and original == group.original_dtype:
        return None
    policy = unit.options.policy
    compute, reduce = policy.compute_dtype(original), policy.grad_reduce_dtype(original)
    return _Plan(unit, group, original, compute, optimizer, reduce)


def _why_not(plan: _Plan) -> str | None:
    """Why ``plan`` cannot be carried out now, or None."""
    unit, group = plan.unit, plan.group
    if not plan.optimizer.is_floating_point:
        return f"the new dtype {plan.optimizer} is not a floating-point dtype"
    if group.codec is not IDENTITY or any(spec is not None for spec in group.tp_specs):
        return "its weights travel through a codec or are tensor-parallel"
    if any(weakref.getweakrefs(p) for p in group.dist_params):  # swap_tensors refuses them
        return "something holds a weak reference to its parameters"
    grads_dtype = unit.options.policy.main_grads_dtype
    if grads_dtype is not None and grads_dtype != plan.optimizer:
        return f"its policy's main_grads_dtype={grads_dtype} would differ from the weights'"
    if unit.state is not TrainingState.IDLE or unit.in_step or unit.region is not None:
        return "it is in a forward or backward, or inside mixed_precision_context"
    reducer, grads = group.reducer, group.grads
    held = grads is not None and any(grads.held(p) is not None for p in group.dist_params)
    if held or (reducer is not None and (reducer.has_grads or reducer.needs_outer_sync)):
        return "gradients are held or waiting to be reduced: call optimizer.zero_grad() first"
    return None


def _refuse_optimizer_state(plans: Sequence[_Plan]) -> None:
    """An optimizer with state for a converted parameter would step it with state of the old
    dtype (torch's Adam fails or mixes dtypes): found among the live objects, once."""
    params = {
        id(p): (plan, name)
        for plan in plans
        for name, p in zip(plan.group.full_names, plan.group.dist_params, strict=True)
    }
    for obj in gc.get_objects():
        if not issubclass(type(obj), torch.optim.Optimizer):  # no __class__ lookups
            continue
        stateful = [params[id(p)] for p, state in obj.state.items() if state and id(p) in params]
        if stateful:
            plan, name = stateful[0]
            raise NotImplementedError(
                f"{type(obj).__name__} already holds state for {len(stateful)} of the "
                f"parameters this conversion would change (e.g. {name!r}, "
                f"{plan.group.dist_params[0].dtype} -> {plan.optimizer}); it would step the "
                "converted weights with state of the old dtype. Convert the model before the "
                "optimizer's first step (e.g. right after fully_shard) or before sharding, or "
                "build a new optimizer after the conversion"
            )


def convert_managed_dtypes(
    module: nn.Module, fn: Conversion, managed: Sequence[nn.Parameter]
) -> None:
    """Carry out ``fn``'s change of dtype on the groups whose parameters ``managed`` (those
    under ``module``) holds, or refuse it before anything changes (see the module note)."""
    owners = {id(g): u for u in units_under(module.modules()) for g in u.groups}
    groups: dict[int, ParameterGroup] = {}
    ids = set()  # of the distributed parameters (``managed`` may hold their unsharded twins)
    for param in managed:
        location = locate(param)
        if location is not None:
            groups.setdefault(id(location.group), location.group)
            ids.add(id(location.dist_param))
    plans: list[_Plan] = []
    for group in groups.values():
        unit = owners.get(id(group))
        if unit is None or not all(id(p) in ids for p in group.dist_params):
            raise NotImplementedError(
                f"converting the dtype of part of an FSDP unit ({group.full_names[0]!r}) is "
                "not supported: call .to(dtype) on the module given to fully_shard, or on an "
                "ancestor of it (the whole model)"
            )
        plan = _plan(unit, group, fn)
        if plan is None:
            continue
        why = _why_not(plan)
        if why is not None:
            raise NotImplementedError(
                f"converting {group.full_names[0]!r} (FSDP unit {unit.name}) from "
                f"{group.dist_params[0].dtype} to {plan.optimizer} after fully_shard is not "
                f"possible now: {why}. Otherwise convert the model before sharding it"
            )
        plans.append(plan)
    if not plans:  # .to(device) of transformers.Trainer, .float() of an fp32 model
        return
    _refuse_optimizer_state(plans)
    for unit in {id(plan.unit): plan.unit for plan in plans}.values():
        unit.reshard()  # as FSDP2's _apply first: the modules hold the sharded parameters
    for plan in plans:
        convert_group_dtype(
            plan.group,
            original=plan.original,
            compute=plan.compute,
            optimizer=plan.optimizer,
            reduce=plan.reduce,
        )
