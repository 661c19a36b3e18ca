"""One forward and backward of the model, run without memory: a copy whose parameters are
``FakeTensor``s runs the example input under ``FakeTensorMode``, and
``mfsdp_buffers.LiveTensorTracker(fake=True)`` counts the storages that would have been
allocated (the activations: saved tensors, temporaries, output, loss, gradients flowing).

The FSDP units' boundaries are reported to a ``StepEvents`` as they happen, at the points
the engine's own hooks fire: a unit's forward starts and ends, its backward starts (the
gradient of its output arrives), each parameter's gradient arrives (``elements``). The
receiver (``ledger.py``) charges the engine's buffers into the same tracker at those points,
so the peak is the peak of both together, in the order they really interleave.

Parameters' gradients are dropped as autograd delivers them: the receiver charges what the
engine keeps of them. The parameters exist before the count starts and are never counted
(the engine's weights are views of its own buffers). The weights are in the compute dtype
and each unit's floating inputs are cast to it, as the engine does.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed.tensor import DTensor
from torch.utils._pytree import tree_flatten, tree_map

from mfsdp_buffers import LiveTensorTracker
from mfsdp_hooks import MixedPrecisionPolicy

__all__ = ["LossFn", "StepEvents", "run_fake_step"]

LossFn = Callable[[Any], torch.Tensor]


class StepEvents(Protocol):
    """What the engine's hooks would see during one step, in order."""

    def forward_start(self, unit: str) -> None: ...

    def forward_end(self, unit: str) -> None: ...

    def loss_start(self) -> None: ...

    def backward_start(self, unit: str) -> None: ...

    def grad_arrived(self, unit: str, param: int) -> None:
        """Parameter ``param`` (its index among the unit's own that require grad) got its
        gradient."""

    def backward_end(self) -> None: ...


def run_fake_step(
    module: nn.Module,
    owners: Sequence[tuple[str, Sequence[nn.Parameter]]],
    example_inputs: Sequence[Any],
    example_kwargs: dict[str, Any] | None,
    *,
    policy: MixedPrecisionPolicy,
    loss_fn: LossFn | None,
    device: torch.device,
    events: StepEvents,
    tracker: LiveTensorTracker,
) -> None:
    """Run ``loss_fn(module(*example_inputs, **example_kwargs)).backward()`` (the sum of the
    floating outputs when ``loss_fn`` is None) on a fake copy of ``module``, counted by
    ``tracker`` (``fake=True``, not yet open), telling ``events`` the boundaries of the units
    in ``owners`` (``(path, parameters it owns)``; ``""`` is ``module`` itself)."""
    if any(type(p).__module__.startswith("torchao.") for p in module.parameters()):
        raise NotImplementedError(
            "example_inputs with torchao float8 weights: their forward is not run on a fake "
            "copy yet (the engine computes with float8 views of the gathered bytes, a fake "
            "copy would cast the weights again). Plan without example_inputs, or plan the "
            "activations with the model before convert_to_float8_training"
        )
    if any(isinstance(p, DTensor) for p in module.parameters()):
        raise NotImplementedError(
            "example_inputs with DTensor (torch tensor-parallel) parameters: their forward "
            "is not run on a fake copy yet. Plan the activations with the model one rank "
            "holds built from plain local layers (as Megatron-Core's), or plan without "
            "example_inputs"
        )
    # Tensors the model keeps outside parameters and buffers are copied as they are, real:
    # the fake mode converts them where they meet fake ones.
    fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
    with fake_mode:
        replica, memo = _fake_copy(module, policy, device)
        inputs = (tuple(example_inputs), example_kwargs or {})
        args, kwargs = _fake_inputs(fake_mode, inputs, device)
    modules = dict(replica.named_modules())
    handles = []
    for name, params in owners:
        handles += _unit_hooks(modules[name], name, events, policy)
        trainable = [p for p in params if p.requires_grad]
        for index, param in enumerate(trainable):  # indices among those that get gradients
            hook = _grad_hook(events, name, index)
            handles.append(memo[id(param)].register_post_accumulate_grad_hook(hook))
    with fake_mode, tracker:
        tracker.ignore([*replica.parameters(), *replica.buffers()])
        try:
            output = replica(*args, **kwargs)
            events.loss_start()
            loss = loss_fn(output) if loss_fn is not None else _sum_floating(output)
            del output
            loss.backward()  # type: ignore[no-untyped-call]
            del loss
            events.backward_end()
        finally:
            for handle in handles:
                handle.remove()


def _grad_hook(events: StepEvents, unit: str, index: int) -> Callable[[torch.Tensor], None]:
    def arrived(param: torch.Tensor) -> None:
        param.grad = None  # the engine takes it over: the events charge what it keeps
        events.grad_arrived(unit, index)

    return arrived


def _unit_hooks(
    module: nn.Module, name: str, events: StepEvents, policy: MixedPrecisionPolicy
) -> list[torch.utils.hooks.RemovableHandle]:
    """Hooks that report ``module``'s forward (casting its floating inputs to the compute
    dtype) and the start of its backward."""

    def pre(_: nn.Module, args: Any, kwargs: Any) -> tuple[Any, Any]:
        if torch.is_grad_enabled():
            events.forward_start(name)
        if policy.param_dtype is not None and policy.cast_forward_inputs:
            args, kwargs = tree_map(lambda t: _cast(t, policy.param_dtype), (args, kwargs))
        return args, kwargs

    def post(_: nn.Module, args: Any, output: Any) -> None:
        if not torch.is_grad_enabled():
            return
        events.forward_end(name)
        for leaf in tree_flatten(output)[0]:
            if isinstance(leaf, torch.Tensor) and leaf.requires_grad:
                leaf.register_hook(lambda grad: events.backward_start(name))  # type: ignore[no-untyped-call]

    return [
        module.register_forward_pre_hook(pre, with_kwargs=True),
        module.register_forward_hook(post),
    ]


def _cast(value: Any, dtype: torch.dtype | None) -> Any:
    if isinstance(value, torch.Tensor) and value.is_floating_point() and dtype is not None:
        return value.to(dtype)
    return value


def _fake_copy(
    module: nn.Module, policy: MixedPrecisionPolicy, device: torch.device
) -> tuple[nn.Module, dict[int, Any]]:
    """``module`` deep-copied with every parameter and buffer replaced by an empty fake
    tensor (parameters in the compute dtype), ties kept, and the fakes by ``id`` of the
    originals; the original is not touched and no real memory of its size is allocated.
    Call inside the fake mode."""
    memo: dict[int, Any] = {}
    for param in module.parameters():
        if id(param) not in memo:
            fake = torch.empty(param.shape, dtype=policy.compute_dtype(param.dtype), device=device)
            memo[id(param)] = nn.Parameter(fake, requires_grad=param.requires_grad)
    for buffer in module.buffers():
        if id(buffer) not in memo:
            memo[id(buffer)] = torch.zeros(buffer.shape, dtype=buffer.dtype, device=device)
    fakes = dict(memo)  # deepcopy adds its own entries to the memo
    return copy.deepcopy(module, memo), fakes


def _fake_inputs(fake_mode: FakeTensorMode, inputs: Any, device: torch.device) -> Any:
    """Real tensors become fakes of themselves (on ``device``); meta tensors become fake
    zeros of their shape (a meta input only says its shape)."""

    def convert(value: Any) -> Any:
        if not isinstance(value, torch.Tensor):
            return value
        if value.device.type == "meta":
            return torch.zeros(value.shape, dtype=value.dtype, device=device)
        return fake_mode.from_tensor(value).to(device)

    return tree_map(convert, inputs)


def _sum_floating(output: Any) -> torch.Tensor:
    leaves = [t for t in tree_flatten(output)[0] if isinstance(t, torch.Tensor) and t.requires_grad]
    if not leaves:
        raise ValueError(
            "the model's output has no tensor that requires grad: pass loss_fn=, a function "
            "from the output to the loss"
        )
    total = leaves[0].float().sum()
    for leaf in leaves[1:]:
        total = total + leaf.float().sum()
    return total
