"""Where a unit's backward begins and ends in autograd's graph.

It begins when the gradient of any of its outputs is computed (``register_pre_backward``).
It ends when the gradients of its inputs exist: a trigger every rank shares.

A unit could also call its backward done when every one of its parameters has a gradient,
but that moment depends on the data: a parameter one rank's forward skipped (an expert that
got no tokens, a branch taken on one rank only) never gets a gradient there. That rank would
then reduce the unit later than its peers, between other collectives, and the ranks would
pair different collectives: a hang, or gradients summed with another unit's. The gradient of
the unit's inputs is computed at the same point of every rank's backward, so (as FSDP2's
``RegisterPostBackwardFunction``) an identity autograd node on the inputs that require grad
tells the unit when its backward is over, whatever its parameters got.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten


class _InputGradTrigger(torch.autograd.Function):
    """Identity on the inputs; its backward runs ``on_inputs_grad`` first."""

    @staticmethod
    def forward(ctx: Any, on_inputs_grad: Callable[[], None], *inputs: torch.Tensor) -> Any:
        ctx.on_inputs_grad = on_inputs_grad
        return inputs

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> Any:
        ctx.on_inputs_grad()
        return (None, *grads)


def route_inputs_through_trigger(
    args: tuple[Any, ...], kwargs: dict[str, Any], on_inputs_grad: Callable[[], None]
) -> tuple[tuple[Any, ...], dict[str, Any], bool]:
    """``args``/``kwargs`` with their tensors that require grad passed through one trigger
    node, and whether there was any (without one, nothing calls ``on_inputs_grad``)."""
    leaves, spec = tree_flatten((args, kwargs))
    positions = [i for i, x in enumerate(leaves) if isinstance(x, torch.Tensor) and x.requires_grad]
    if not positions or not torch.is_grad_enabled():
        return args, kwargs, False
    routed = _InputGradTrigger.apply(  # type: ignore[no-untyped-call]
        on_inputs_grad, *(leaves[i] for i in positions)
    )
    for position, tensor in zip(positions, routed, strict=True):
        leaves[position] = tensor
    new_args, new_kwargs = tree_unflatten(leaves, spec)
    return new_args, new_kwargs, True


def register_pre_backward(output: Any, hook: Callable[[torch.Tensor], None]) -> None:
    """``hook`` runs when the gradient of any of ``output``'s tensors is computed."""
    tensors, _ = tree_flatten(output)
    for tensor in tensors:
        if isinstance(tensor, torch.Tensor) and tensor.requires_grad:
            tensor.register_hook(hook)  # type: ignore[no-untyped-call]
