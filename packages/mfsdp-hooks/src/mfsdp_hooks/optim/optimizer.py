"""Optimizer integration: step on the sharded main weights, then refresh compute weights.

The package README's "optimizer integration" says why a bare optimizer's step is unseen
(``weight_freshness`` keeps the step window) and what ``attach_optimizer`` adds: the class
``FSDP<its class>``, whose ``step`` closes the window itself and steps over contiguous runs
(:mod:`.contiguous_step`), or, for an optimizer whose ``step`` an LR scheduler wrapped on the
instance before attaching, the same work as its own step hooks (``_StepHooks``).
"""

from __future__ import annotations

from collections.abc import Iterable
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any

import torch

from mfsdp_hooks.optim.contiguous_step import CONTIGUOUS_STEP_OPTIMIZERS, ContiguousStepper
from mfsdp_hooks.optim.muon import Muon
from mfsdp_hooks.runtime import timeline
from mfsdp_hooks.runtime.elementwise_optimizers import (
    USER_CLASS_ATTR,
    refuse_sharded_non_elementwise,
)
from mfsdp_hooks.runtime.stale_optimizers import compute_params_of
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


def _finish_grad_sync(groups: Iterable[ParameterGroup]) -> None:
    """``finish_grad_sync`` once on each root behind ``groups``."""
    roots: dict[int, GroupRoot] = {}
    for group in groups:
        if group.root is not None:
            roots.setdefault(id(group.root), group.root)
    for root in roots.values():
        root.finish_grad_sync()


def _is_fsdp_param(param: torch.Tensor) -> bool:
    return param.requires_grad and locate(param) is not None


def _stepper_for(
    optimizer: torch.optim.Optimizer, contiguous_step: bool | None, step_chunk_numel: int | None
) -> ContiguousStepper | None:
    if contiguous_step is None:
        contiguous_step = type(optimizer) in CONTIGUOUS_STEP_OPTIMIZERS
    elif not isinstance(contiguous_step, bool):
        raise TypeError(f"contiguous_step must be a bool or None, got {contiguous_step!r}")
    if not contiguous_step:
        return None
    return ContiguousStepper(optimizer, _is_fsdp_param, step_chunk_numel)


def _install(groups: Iterable[ParameterGroup]) -> None:
    for group in groups:
        handle = group.install_weights()
        if handle is not None:
            handle.wait()


class _StepHooks:
    """``FSDPOptimizer.step``'s work as torch's public per-optimizer step hooks, for an
    optimizer whose ``step`` was wrapped on the instance before it was attached.

    Torch's LR scheduler, when built, stores on the instance a wrapper that records the call
    (``scheduler.step()`` warns without it, so it stays) and calls the function the class's
    ``step`` was then (torch's hook runner around the user class's step), so a class given
    later is never reached but hooks registered here see every step. The contiguous step
    needs a context restored even when torch's step raises, which a pre/post hook pair cannot
    give: these steps take torch's per-parameter path (bit for bit the same result). A step
    pre-hook added before attaching runs before the gradients are synced here (torch runs
    hooks in the order registered)."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self._install_after = True
        optimizer.register_step_pre_hook(self._before)
        optimizer.register_step_post_hook(self._after)

    def _before(
        self, optimizer: torch.optim.Optimizer, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        kwargs = dict(kwargs)  # the seed's keywords are ours: torch's step takes neither
        sync = kwargs.pop("sync_grad_before_optimizer_step", True)
        self._install_after = kwargs.pop("install_optimized_model_weights", True)
        groups = optimizer_groups(optimizer)
        if sync:
            _finish_grad_sync(groups)
        # Marked stepped before torch's step, which reads no freshness: a step that raises
        # half-way still leaves the next forward to re-install the weights.
        for group in groups:
            group.freshness.close_step_window(stepped=True)
        return args, kwargs

    def _after(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if self._install_after:
            _install(optimizer_groups(optimizer))


@dataclass(frozen=True)
class _Attachment:
    stepper: ContiguousStepper | None
    step_hooks: _StepHooks | None = None


_ATTACHMENT = "_mfsdp_attachment"
_FSDP_OPTIMIZER_CLASSES: dict[type[torch.optim.Optimizer], type[torch.optim.Optimizer]] = {}


class FSDPOptimizer(torch.optim.Optimizer):
    """What an attached optimizer's class adds: the seed README's keyword arguments."""

    def _attachment(self) -> _Attachment | None:
        # A copy (copy.copy keeps only the optimizer's own state) steps the torch way.
        attachment = self.__dict__.get(_ATTACHMENT)
        return attachment if isinstance(attachment, _Attachment) else None

    def step(
        self,
        *args: Any,
        sync_grad_before_optimizer_step: bool = True,
        install_optimized_model_weights: bool = True,
        **kwargs: Any,
    ) -> Any:
        attachment = self._attachment()
        if attachment is not None and attachment.step_hooks is not None:  # hooks do the work
            kwargs["sync_grad_before_optimizer_step"] = sync_grad_before_optimizer_step
            kwargs["install_optimized_model_weights"] = install_optimized_model_weights
            return super().step(*args, **kwargs)
        recorder = timeline.ACTIVE
        # a timeline times all of it as the optimizer's
        with nullcontext() if recorder is None else recorder.attached_step(self):
            current = optimizer_groups(self)
            if sync_grad_before_optimizer_step:
                _finish_grad_sync(current)
            stepper = None if attachment is None else attachment.stepper
            closure = args[0] if args else kwargs.get("closure")
            try:
                if stepper is not None and closure is not None:
                    stepper.hand_back()  # the closure re-creates gradients: torch's loop steps
                    stepper = None
                with nullcontext() if stepper is None else stepper.stepping():
                    result = super().step(*args, **kwargs)
            finally:  # even a step that failed half-way may have changed weights
                for group in current:
                    group.freshness.close_step_window(stepped=True)
            if install_optimized_model_weights:
                _install(current)
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


def _step_wrapped_on_instance(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``step`` is a wrapper on the instance that calls the class's step, which runs
    torch's step hooks (``functools.wraps`` says what it wraps: torch's LR schedulers' does);
    any other replacement of ``step`` or ``zero_grad`` on the instance is refused."""
    instance_step = optimizer.__dict__.get("step")
    class_step = type(optimizer).step
    runs_hooks = getattr(instance_step, "__wrapped__", None) is class_step and getattr(
        class_step, "hooked", False
    )
    if "zero_grad" in optimizer.__dict__ or (instance_step is not None and not runs_hooks):
        replaced = "zero_grad" if "zero_grad" in optimizer.__dict__ else "step"
        raise ValueError(
            f"optimizer: its {replaced} was replaced on the instance by something that does "
            f"not call {type(optimizer).__name__}.{replaced} (torch's LR schedulers' wrapper "
            "does, and is accepted); call attach_optimizer / fully_shard_optimizer before "
            f"replacing {replaced}"
        )
    return instance_step is not None


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
    An LR scheduler may be built before or after: one built before wrapped ``step`` on the
    instance, so the FSDP work runs as step hooks and the step takes torch's per-parameter
    path (``contiguous_step=True`` is then refused). A ``torch.optim.Muon`` becomes
    :class:`~mfsdp_hooks.optim.muon.Muon`, exact on shards; any other optimizer that would
    step shards of parameters without an element-wise update (LBFGS) is refused
    (:mod:`mfsdp_hooks.runtime.elementwise_optimizers`).
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
    if gathered := compute_params_of(optimizer):
        raise ValueError(
            f"optimizer holds {len(gathered)} gathered compute weights ({gathered[0]}, ...) "
            "that a unit keeps in the model from a forward with autograd on until its "
            "backward, not the sharded parameters: build it on model.parameters() before "
            "such a forward or after a backward (or run that forward under torch.no_grad())"
        )
    wrapped_step = _step_wrapped_on_instance(optimizer)
    if wrapped_step and contiguous_step:
        raise ValueError(
            "contiguous_step=True: the optimizer's step was wrapped on the instance (an LR "
            "scheduler built before attach_optimizer / fully_shard_optimizer does this), and "
            "the contiguous step runs only inside the class's step; build the scheduler after "
            "attaching, or leave contiguous_step unset (torch's per-parameter step, same result)"
        )
    _check_reads_decoupled_grads(optimizer)
    if type(optimizer) is torch.optim.Muon:
        # Handed to us: ours has its arguments, groups and state, and is exact on shards.
        optimizer.__class__ = Muon
    refuse_sharded_non_elementwise(optimizer)
    stepper = None if wrapped_step else _stepper_for(optimizer, contiguous_step, step_chunk_numel)
    for group in optimizer_groups(optimizer):
        group.freshness.attach_stepper()
    hooks = _StepHooks(optimizer) if wrapped_step else None
    optimizer.__dict__[_ATTACHMENT] = _Attachment(stepper, hooks)
    optimizer.__class__ = _fsdp_optimizer_class(type(optimizer))
    return optimizer
