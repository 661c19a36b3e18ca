"""Optimizers still holding the parameters ``fully_shard`` replaced: refused at their step.

An optimizer built before sharding holds the user's original parameters, while the model
computes with new ones (``group_storage.adopt_params``): it would step stale tensors and
training would silently stop. Optimizers handed to us are re-pointed at the replacements;
any other is found once, when the root starts its first forward, and gets a step pre-hook
(torch's public, per-optimizer hook: nothing process-wide) that raises naming the parameters,
and removes itself after the first step that passes.

The same scan refuses, on every rank, an optimizer that would step shards of the starting
root's parameters without an element-wise update (``elementwise_optimizers``), and lays out
as its parameters the state a load gave it (``load_rows.own_optimizer_rows``), now and after
each later ``load_state_dict``. This is collective: the optimizers are taken in the order of
their parameters in the root (the same on every rank), not in the collector's order.

The root's first backward looks once more (``guard_optimizers_on_compute_params``) for
optimizers built on ``model.parameters()`` after a forward whose backward had not run: they
hold the gathered compute weights a unit shows until its backward.
"""

from __future__ import annotations

import contextlib
import gc
import weakref
from collections.abc import Sequence
from typing import Any

import torch

from mfsdp_hooks.dtensor.load_rows import own_optimizer_rows
from mfsdp_hooks.runtime.elementwise_optimizers import refuse_sharded_non_elementwise
from mfsdp_hooks.weights.lookup import locate, replaced_by_unit
from mfsdp_hooks.weights.param_group import ParameterGroup

__all__ = [
    "compute_params_of",
    "guard_optimizers_on_compute_params",
    "guard_optimizers_on_replaced_params",
    "replaced_params_of",
]

_GUARDED_ATTR = "_mfsdp_replaced_params_guard"


def replaced_params_of(optimizer: torch.optim.Optimizer) -> list[str]:
    """``"group g, position i: <unit(param)>"`` for each replaced parameter it holds."""
    return [
        f"group {g}, position {i}: {owner}"
        for g, group in enumerate(optimizer.param_groups)
        for i, param in enumerate(group["params"])
        if (owner := replaced_by_unit(param)) is not None
    ]


def compute_params_of(optimizer: torch.optim.Optimizer) -> list[str]:
    """``"group g, position i: <name>"`` for each gathered compute weight it holds (a unit's
    unsharded parameter, not the sharded one an optimizer steps)."""
    return [
        f"group {g}, position {i}: {location.group.full_names[location.index]}"
        for g, group in enumerate(optimizer.param_groups)
        for i, param in enumerate(group["params"])
        if (location := locate(param)) is not None
        and param is not location.dist_param
        and replaced_by_unit(param) is None
    ]


def _listed(found: list[str]) -> str:
    return "; ".join(found[:4]) + ("; ..." if len(found) > 4 else "")


def _guard(optimizer: torch.optim.Optimizer) -> None:
    handle: Any = None

    def refuse_stale_params(opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        stale, gathered = replaced_params_of(opt), compute_params_of(opt)
        if not stale and not gathered:
            handle.remove()
            opt.__dict__.pop(_GUARDED_ATTR, None)
            return
        if not stale:
            raise RuntimeError(
                f"{type(opt).__name__}.step(): {len(gathered)} of its parameters are gathered "
                f"compute weights ({_listed(gathered)}), which a unit keeps in the model from "
                "a forward with autograd on until its backward; it was built on "
                "model.parameters() after a forward whose backward had not run, and would step "
                "copies the model never reads, so those weights would not train. Build it "
                "before such a forward (or after a backward), run that forward under "
                "torch.no_grad(), or hand it over: megatron_fsdp.fully_shard_optimizer("
                "optimizer) re-points it"
            )
        listed = _listed(stale)
        raise RuntimeError(
            f"{type(opt).__name__}.step(): {len(stale)} of its parameters were replaced by "
            f"fully_shard ({listed}); it would step stale copies the model no longer uses, "
            "so nothing would train. Build the optimizer after sharding, on "
            "model.parameters(), or hand it over: megatron_fsdp.fully_shard(model, "
            "optimizer) or megatron_fsdp.fully_shard_optimizer(optimizer) re-point it"
        )

    handle = optimizer.register_step_pre_hook(refuse_stale_params)
    optimizer.__dict__[_GUARDED_ATTR] = True


def guard_optimizers_on_replaced_params(starting: Sequence[ParameterGroup] = ()) -> None:
    """Find the live optimizers that hold replaced parameters and guard their step; refuse
    one that is not element-wise over shards of ``starting`` (the groups of the root whose
    first forward this is: a refused optimizer of another model, still alive, stays quiet).

    Called in the first forward, which may be under ``torch.compile``: the scan of the
    collector's objects is a runtime look at the process, never traced into a graph (the
    objects change while dynamo iterates them)."""
    scan = torch.compiler.disable(  # type: ignore[no-untyped-call]
        _guard_live_optimizers, reason="a scan of gc's objects"
    )
    scan(starting)


def guard_optimizers_on_compute_params() -> None:
    """Guard the step of each live optimizer that holds gathered compute weights (local: no
    collective; every rank built its optimizers alike, so every rank refuses alike)."""
    scan = torch.compiler.disable(  # type: ignore[no-untyped-call]
        _guard_compute_holders, reason="a scan of gc's objects"
    )
    scan()


def _guard_compute_holders() -> None:
    for obj in gc.get_objects():
        if (
            issubclass(type(obj), torch.optim.Optimizer)
            and _GUARDED_ATTR not in obj.__dict__
            and compute_params_of(obj)
        ):
            _guard(obj)


def _guard_live_optimizers(starting: Sequence[ParameterGroup]) -> None:
    found: list[tuple[list[tuple[int, int]], torch.optim.Optimizer]] = []
    for obj in gc.get_objects():
        if not issubclass(type(obj), torch.optim.Optimizer):
            continue
        refuse_sharded_non_elementwise(obj, within=starting)
        if _GUARDED_ATTR not in obj.__dict__ and replaced_params_of(obj):
            _guard(obj)
        if positions := _positions_in(obj, starting):
            found.append((positions, obj))
    for _, optimizer in sorted(found, key=lambda item: item[0]):
        _follow_loaded_state(optimizer)


def _positions_in(
    optimizer: torch.optim.Optimizer, starting: Sequence[ParameterGroup]
) -> list[tuple[int, int]]:
    """(group position in ``starting``, index) of each parameter of ``optimizer`` there: the
    same on every rank, so the optimizers can be taken in an order that pairs collectives."""
    order = {id(group): position for position, group in enumerate(starting)}
    return [
        (order[id(location.group)], location.index)
        for group in optimizer.param_groups
        for param in group["params"]
        if (location := locate(param)) is not None and id(location.group) in order
    ]


_FOLLOWED: weakref.WeakSet[torch.optim.Optimizer] = weakref.WeakSet()


def _follow_loaded_state(optimizer: torch.optim.Optimizer) -> None:
    """Lay out what a load gave ``optimizer`` as its parameters, now and after each load."""
    own_optimizer_rows(optimizer)
    if optimizer not in _FOLLOWED:  # a membership test only: never iterated
        _FOLLOWED.add(optimizer)
        # A wrapper that never ran Optimizer.__init__ (accelerate's AcceleratedOptimizer) has
        # no hooks: its loads run the wrapped optimizer's, which the scan found too.
        with contextlib.suppress(AttributeError):
            optimizer.register_load_state_dict_post_hook(own_optimizer_rows)
