"""A region of the program with another mixed-precision policy than the one a model was
wrapped with (``mixed_precision_context``; the megatron-fsdp README says what it changes).

In a region that changes ``param_dtype``, each unit gathers its compute weights as usual (in
the trained dtype: the region saves no communication) and installs copies cast to the
region's dtype for its forward (bit for bit what gathering in that dtype gives: a cast
commutes with a gather). Such copies take no gradients, so a forward there must run without
autograd: one with autograd on raises instead of training nothing. What the model stores
(``main_params_dtype``, ``main_grads_dtype``, ``use_decoupled_grad``) cannot change for a
region. The region state lives on each unit (``FSDPUnit.region``);
``enter_region``/``leave_region`` are its only transitions.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import nn
from torch.utils._pytree import tree_map

from mfsdp_hooks.config.codec import IDENTITY
from mfsdp_hooks.config.mixed_precision import MixedPrecisionPolicy
from mfsdp_hooks.config.unit_options import UnitOptions
from mfsdp_hooks.weights.param_group import ParameterGroup

__all__ = [
    "ComputeRegion",
    "RegionUnit",
    "cast_inputs",
    "cast_outputs",
    "enter_region",
    "forward_policy",
    "installed_params",
    "leave_region",
]

_STORED = ("main_params_dtype", "main_grads_dtype", "use_decoupled_grad")


@dataclass(frozen=True)
class ComputeRegion:
    """One unit's region: the policy its forward and reductions follow while it lasts."""

    policy: MixedPrecisionPolicy

    def compute_dtype(self, group: ParameterGroup) -> torch.dtype:
        return self.policy.compute_dtype(group.original_dtype)

    def casts(self, group: ParameterGroup) -> bool:
        """Whether the region's forward computes ``group`` in another dtype than training."""
        return self.compute_dtype(group) != group.compute_dtype

    def params(self, group: ParameterGroup) -> Sequence[nn.Parameter]:
        """The parameters the region's forward uses: the gathered ones, or casts of them."""
        if not self.casts(group):
            return group.unsharded_params
        dtype = self.compute_dtype(group)
        return [
            nn.Parameter(p.detach().to(dtype), requires_grad=False) if p.is_floating_point() else p
            for p in group.unsharded_params
        ]


def forward_policy(options: UnitOptions, region: ComputeRegion | None) -> MixedPrecisionPolicy:
    """The policy a unit's forward follows now: the region's, or the wrap-time one."""
    return options.policy if region is None else region.policy


def installed_params(
    group: ParameterGroup, unsharded: bool, region: ComputeRegion | None
) -> Sequence[nn.Parameter]:
    """What a unit puts in its modules: the sharded parameters, the gathered ones, or a
    region's casts of them."""
    if not unsharded:
        return group.dist_params
    return group.unsharded_params if region is None else region.params(group)


class RegionUnit(Protocol):
    """What a region reads and sets on a unit (``FSDPUnit``)."""

    name: str
    options: UnitOptions
    groups: list[ParameterGroup]
    region: ComputeRegion | None

    @property
    def in_step(self) -> bool: ...

    def reinstall_params(self) -> None: ...


def _check(unit: RegionUnit, region: ComputeRegion) -> None:
    model_policy = unit.options.policy
    for name in _STORED:
        if getattr(region.policy, name) != getattr(model_policy, name):
            raise ValueError(
                f"mixed_precision_context: {name}={getattr(region.policy, name)!r} differs "
                f"from the model's {getattr(model_policy, name)!r}; a region changes "
                "param_dtype, reduce_dtype, output_dtype and cast_forward_inputs only: start "
                "from dataclasses.replace(model.mixed_precision_policy, ...)"
            )
    for group in unit.groups:
        if not region.casts(group):
            continue
        if group.codec is not IDENTITY:
            raise NotImplementedError(
                f"mixed_precision_context(param_dtype={region.compute_dtype(group)}): "
                f"{group.names[0]!r} is gathered through a codec (FP8 weights), whose compute "
                "weights a region cannot cast; keep param_dtype for such models"
            )
        main_dtype = group.main.dtype if group.main is not None else group.compute_dtype
        if group.compute_dtype != main_dtype or not group.compute_dtype.is_floating_point:
            raise NotImplementedError(
                f"mixed_precision_context(param_dtype={region.compute_dtype(group)}) for "
                f"{group.names[0]!r}, whose weights compute in {group.compute_dtype} from "
                f"{main_dtype} main weights: the region casts the gathered compute weights, "
                "which would round them twice; this is supported when the model computes in "
                "its main weights' dtype (e.g. fp32 training) or the region keeps param_dtype"
            )
    if unit.in_step or any(g.reducer is not None and g.reducer.has_grads for g in unit.groups):
        raise RuntimeError(
            f"mixed_precision_context: unit {unit.name} is inside a step (a forward, a "
            "backward or unreduced gradients); enter and leave the region between steps"
        )


def enter_region(units: Sequence[RegionUnit], policy: MixedPrecisionPolicy) -> None:
    """Give every unit the region (checked on all of them first: all or none enter)."""
    region = ComputeRegion(policy)
    for unit in units:
        if unit.region is not None:
            raise RuntimeError("mixed_precision_context: regions do not nest; leave it first")
        _check(unit, region)
    for unit in units:
        unit.region = region
        for group in unit.groups:
            if group.reducer is not None:
                group.reducer.set_reduce_dtype(policy.grad_reduce_dtype(group.original_dtype))


def leave_region(units: Sequence[RegionUnit]) -> None:
    """Back to the wrap-time policy: reductions in its dtype, the gathered weights (not the
    region's casts) in the modules."""
    for unit in units:
        unit.region = None
        for group in unit.groups:
            if group.reducer is not None:
                group.reducer.set_reduce_dtype(group.wrap_reduce_dtype)
        unit.reinstall_params()


def _cast_floats(tree: Any, dtype: torch.dtype) -> Any:
    return tree_map(
        lambda t: t.to(dtype) if isinstance(t, torch.Tensor) and t.is_floating_point() else t,
        tree,
    )


def cast_inputs(
    policy: MixedPrecisionPolicy, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """Floating-point inputs in the compute dtype, when the policy asks for it."""
    dtype = policy.param_dtype
    if dtype is None or not policy.cast_forward_inputs:
        return args, kwargs
    cast: tuple[tuple[Any, ...], dict[str, Any]] = _cast_floats((args, kwargs), dtype)
    return cast


def cast_outputs(policy: MixedPrecisionPolicy, output: Any) -> Any:
    """Floating-point outputs in the policy's output dtype (the root's), when it has one."""
    dtype = policy.output_dtype
    return output if dtype is None else _cast_floats(output, dtype)
