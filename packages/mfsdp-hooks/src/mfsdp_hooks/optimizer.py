"""Optimizer integration: step on the sharded main weights, then refresh compute weights.

Any ``torch.optim.Optimizer`` works unmodified: a global step post-hook marks the parameter
groups it stepped as dirty, and each group re-installs its compute weights lazily at its next
unshard. ``attach_optimizer`` adds the seed's explicit controls to ``step`` and ``zero_grad``,
and steps Adam, AdamW and SGD over contiguous runs of the sharded buffers
(:mod:`mfsdp_hooks.contiguous_step`).
"""

from __future__ import annotations

import types
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook

from mfsdp_hooks.contiguous_step import ContiguousStepper, supports_contiguous_step
from mfsdp_hooks.lookup import locate
from mfsdp_hooks.param_group import ParameterGroup
from mfsdp_hooks.root_protocol import GroupRoot

_GROUPS_CACHE = "_mfsdp_groups_cache"
_STEPPER = "_mfsdp_contiguous_stepper"


def optimizer_groups(optimizer: torch.optim.Optimizer) -> list[ParameterGroup]:
    """The FSDP parameter groups an optimizer steps, computed once per parameter list."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    cached = getattr(optimizer, _GROUPS_CACHE, None)
    if cached is not None and cached[0] == len(params):
        groups: list[ParameterGroup] = cached[1]
        return groups
    seen: dict[int, ParameterGroup] = {}
    for param in params:
        location = locate(param)
        if location is not None:
            seen.setdefault(id(location.group), location.group)
    groups = list(seen.values())
    setattr(optimizer, _GROUPS_CACHE, (len(params), groups))
    return groups


def _mark_weights_dirty(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    stepper: ContiguousStepper | None = getattr(optimizer, _STEPPER, None)
    if stepper is not None and stepper.active:
        return  # the parameter lists hold flat chunks now; the step wrapper marks them after
    for group in optimizer_groups(optimizer):
        group.mark_weights_dirty()


_HOOK = register_optimizer_step_post_hook(_mark_weights_dirty)


def _roots(groups: Iterable[ParameterGroup]) -> list[GroupRoot]:
    roots: dict[int, GroupRoot] = {}
    for group in groups:
        root = group.root
        if root is not None:
            roots.setdefault(id(root), root)
    return list(roots.values())


def _is_fsdp_param(param: torch.Tensor) -> bool:
    return param.requires_grad and locate(param) is not None


def _stepper_for(
    optimizer: torch.optim.Optimizer, contiguous_step: bool | None, step_chunk_numel: int | None
) -> ContiguousStepper | None:
    if contiguous_step is None:
        contiguous_step = supports_contiguous_step(optimizer)
    elif not isinstance(contiguous_step, bool):
        raise TypeError(f"contiguous_step must be a bool or None, got {contiguous_step!r}")
    if not contiguous_step:
        return None
    return ContiguousStepper(optimizer, _is_fsdp_param, step_chunk_numel)


def attach_optimizer(
    optimizer: torch.optim.Optimizer,
    *,
    contiguous_step: bool | None = None,
    step_chunk_numel: int | None = None,
) -> torch.optim.Optimizer:
    """Give ``optimizer.step``/``zero_grad`` the seed README's FSDP keyword arguments.

    ``contiguous_step`` (default: on for Adam, AdamW and SGD, which it supports) steps runs
    of parameters that lie back to back in a sharded buffer as flat chunks of at most
    ``step_chunk_numel`` elements (default: 2**18 on CPU, whole runs elsewhere); the result
    is bit for bit that of torch's per-parameter step. Fused groups, a step given a closure,
    and runs whose gradients or state are not laid out that way take torch's own path.
    """
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(
            f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}"
        )
    groups = optimizer_groups(optimizer)
    if not groups:
        raise ValueError(
            "optimizer holds no fully-sharded parameters: build it from the sharded model's "
            "parameters (after fully_shard_model / MegatronFSDP), e.g. "
            "torch.optim.AdamW(model.parameters())"
        )
    if getattr(optimizer, "_mfsdp_attached", False):
        return optimizer
    stepper = _stepper_for(optimizer, contiguous_step, step_chunk_numel)
    original_step: Callable[..., Any] = optimizer.step
    original_zero_grad: Callable[..., Any] = optimizer.zero_grad

    def step(
        self: torch.optim.Optimizer,
        *args: Any,
        sync_grad_before_optimizer_step: bool = True,
        install_optimized_model_weights: bool = True,
        **kwargs: Any,
    ) -> Any:
        current = optimizer_groups(self)
        if sync_grad_before_optimizer_step:
            for root in _roots(current):
                root.finish_grad_sync()
        closure = args[0] if args else kwargs.get("closure")
        if stepper is None or closure is not None:
            if stepper is not None:
                stepper.hand_back()
            result = original_step(*args, **kwargs)
        else:
            try:
                with stepper.stepping():
                    result = original_step(*args, **kwargs)
            finally:  # even a step that failed half-way may have changed weights
                for group in current:
                    group.mark_weights_dirty()
        if install_optimized_model_weights:
            for group in current:
                handle = group.install_weights()
                if handle is not None:
                    handle.wait()
        return result

    def zero_grad(
        self: torch.optim.Optimizer,
        *args: Any,
        zero_grad_buffer: bool = True,
        **kwargs: Any,
    ) -> None:
        original_zero_grad(*args, **kwargs)
        if zero_grad_buffer:
            for group in optimizer_groups(self):
                group.zero_main_grads()

    optimizer.step = types.MethodType(step, optimizer)  # type: ignore[method-assign]
    optimizer.zero_grad = types.MethodType(zero_grad, optimizer)  # type: ignore[method-assign]
    setattr(optimizer, _STEPPER, stepper)
    optimizer._mfsdp_attached = True  # type: ignore[attr-defined]
    return optimizer
