"""Optimizer integration: step on the sharded main weights, then refresh compute weights.

Any ``torch.optim.Optimizer`` works unmodified, and nothing is registered process-wide: the
engine cannot see a bare optimizer step (an FSDP2-style loop builds one the engine never
meets, and an optimizer writing through DTensors bumps no version counter it could read), so
from a backward that synced the gradients until the next backward each forward re-installs
the compute weights (``weight_freshness.WeightFreshness``). Under ZeRO-3 that is the gather a
forward makes anyway; a unit that keeps its weights (ZeRO-0/1/2, or no reshard after
forward) pays one install per forward in that window.

``attach_optimizer`` gives the optimizer the class ``FSDP<its class>`` (as ``fully_shard``
does for modules; one class per optimizer class, nothing patched on the instance): its
``step`` closes the window itself (weights are installed once, right after the step) and
takes the seed's keyword arguments, and it steps Adam, AdamW and SGD over contiguous runs of
the sharded buffers (:mod:`mfsdp_hooks.optim.contiguous_step`).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch

from mfsdp_hooks.optim.contiguous_step import ContiguousStepper, supports_contiguous_step
from mfsdp_hooks.runtime import timeline
from mfsdp_hooks.runtime.elementwise_optimizers import (
    USER_CLASS_ATTR,
    refuse_sharded_non_elementwise,
)
from mfsdp_hooks.weights.lookup import locate
from mfsdp_hooks.weights.param_group import GroupRoot, ParameterGroup

_GROUPS_CACHE = "_mfsdp_groups_cache"


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


@dataclass(frozen=True)
class _Attachment:
    stepper: ContiguousStepper | None


_ATTACHMENT = "_mfsdp_attachment"
_FSDP_OPTIMIZER_CLASSES: dict[type[torch.optim.Optimizer], type[torch.optim.Optimizer]] = {}


class FSDPOptimizer(torch.optim.Optimizer):
    """What an attached optimizer's class adds: the seed README's keyword arguments."""

    def _mfsdp_stepper(self) -> ContiguousStepper | None:
        # A copy (copy.copy keeps only the optimizer's own state) steps the torch way.
        attachment = self.__dict__.get(_ATTACHMENT)
        return attachment.stepper if isinstance(attachment, _Attachment) else None

    def step(
        self,
        *args: Any,
        sync_grad_before_optimizer_step: bool = True,
        install_optimized_model_weights: bool = True,
        **kwargs: Any,
    ) -> Any:
        recorder = timeline.ACTIVE
        if recorder is None:
            return self._fsdp_step(
                args, kwargs, sync_grad_before_optimizer_step, install_optimized_model_weights
            )
        with recorder.attached_step(self):  # a timeline times all of it as the optimizer's
            return self._fsdp_step(
                args, kwargs, sync_grad_before_optimizer_step, install_optimized_model_weights
            )

    def _fsdp_step(
        self,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        sync_grad_before_optimizer_step: bool,
        install_optimized_model_weights: bool,
    ) -> Any:
        current = optimizer_groups(self)
        if sync_grad_before_optimizer_step:
            for root in _roots(current):
                root.finish_grad_sync()
        stepper = self._mfsdp_stepper()
        closure = args[0] if args else kwargs.get("closure")
        try:
            if stepper is None or closure is not None:
                if stepper is not None:
                    stepper.hand_back()
                result = super().step(*args, **kwargs)
            else:
                with stepper.stepping():
                    result = super().step(*args, **kwargs)
        finally:  # even a step that failed half-way may have changed weights
            for group in current:
                group.freshness.close_step_window(stepped=True)
        if install_optimized_model_weights:
            for group in current:
                handle = group.install_weights()
                if handle is not None:
                    handle.wait()
        return result

    def zero_grad(self, set_to_none: bool = True, *, zero_grad_buffer: bool = True) -> None:
        super().zero_grad(set_to_none)
        for group in optimizer_groups(self):  # one walk over the groups
            group.clear_optimizer_grads(set_to_none=set_to_none)  # ``decoupled_grad``
            if zero_grad_buffer:
                group.zero_main_grads()


# torch wraps a class's ``step`` in its hook runner when an optimizer is built or loads a
# state dict (``Optimizer._patch_step_function``) unless the function says it is wrapped.
# Ours calls the optimizer class's own step, which is wrapped: marked so, step hooks run once,
# inside it, where they see what the step sees.
FSDPOptimizer.step.hooked = True  # type: ignore[attr-defined]


def _check_reads_decoupled_grads(optimizer: torch.optim.Optimizer) -> None:
    """Refuse an optimizer that would read ``.grad`` of parameters whose gradients are in
    ``decoupled_grad``: it would see no gradient and silently skip them. Torch's built-in
    optimizers read ``.grad``; others say so with ``use_decoupled_grad`` (Transformer
    Engine's ``FusedAdam``), or are trusted to read ``decoupled_grad``."""
    decoupled = [
        g for g in optimizer_groups(optimizer) if g.grads is not None and g.grads.decoupled
    ]
    if not decoupled:
        return
    reads_grad = type(optimizer).__module__.startswith("torch.optim") or (
        getattr(optimizer, "use_decoupled_grad", True) is False
    )
    if reads_grad:
        raise ValueError(
            f"optimizer: {type(optimizer).__name__} reads .grad, but {decoupled[0].names[0]!r} "
            "(and every parameter of a model sharded with MixedPrecisionPolicy("
            "use_decoupled_grad=True)) hands its gradient over in .decoupled_grad; use an "
            "optimizer that reads decoupled_grad (e.g. Transformer Engine's FusedAdam("
            "use_decoupled_grad=True)), or leave use_decoupled_grad False"
        )


def _fsdp_optimizer_class(cls: type[torch.optim.Optimizer]) -> type[torch.optim.Optimizer]:
    found = _FSDP_OPTIMIZER_CLASSES.get(cls)
    if found is None:
        found = type(f"FSDP{cls.__name__}", (FSDPOptimizer, cls), {USER_CLASS_ATTR: cls})
        _FSDP_OPTIMIZER_CLASSES[cls] = found
    return found


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
    Attach before creating LR schedulers (they wrap ``step`` on the instance). An optimizer
    that would step shards of parameters without an element-wise update (Muon, LBFGS) is
    refused (:mod:`mfsdp_hooks.runtime.elementwise_optimizers`).
    """
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(
            f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}"
        )
    if not optimizer_groups(optimizer):
        raise ValueError(
            "optimizer holds no fully-sharded parameters: build it from the sharded model's "
            "parameters (after fully_shard_model / MegatronFSDP), e.g. "
            "torch.optim.AdamW(model.parameters())"
        )
    if isinstance(optimizer, FSDPOptimizer):
        return optimizer
    if "step" in optimizer.__dict__ or "zero_grad" in optimizer.__dict__:
        raise ValueError(
            "optimizer: its step or zero_grad was already wrapped on the instance (an LR "
            "scheduler does this); call attach_optimizer / fully_shard_optimizer right after "
            "building the optimizer, before creating schedulers"
        )
    _check_reads_decoupled_grads(optimizer)
    refuse_sharded_non_elementwise(optimizer)
    stepper = _stepper_for(optimizer, contiguous_step, step_chunk_numel)
    for group in optimizer_groups(optimizer):
        group.freshness.attach_stepper()
    optimizer.__dict__[_ATTACHMENT] = _Attachment(stepper)
    optimizer.__class__ = _fsdp_optimizer_class(type(optimizer))
    return optimizer
