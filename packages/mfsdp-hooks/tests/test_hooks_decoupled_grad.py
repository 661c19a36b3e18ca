"""``MixedPrecisionPolicy(use_decoupled_grad=True)``: the reduced gradients in
``param.decoupled_grad``, ``.grad`` left None, and everything that hands gradients over
(accumulation, ``zero_grad``, ``optimizer_grad``, the refusal of ``.grad`` readers) right.

The entry-point matrix (``test_megatron_fsdp_matrix.py``, column ``decoupled_grad``) checks
training parity through every entry point; this file checks the gradient's life cycle.
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch
from hooks_models import (
    Block,
    assert_close_rel,
    local_slice,
    loss_fn,
    make_batches,
    make_model,
    trainable,
)

from mfsdp_collectives.testing import run_distributed
from mfsdp_hooks import (
    FSDPRootWrapper,
    MixedPrecisionPolicy,
    ShardingOptions,
    attach_optimizer,
    declare_elementwise_optimizer,
    local_tensor,
    optimizer_grad,
)

GLOBAL_BATCH = 8  # divisible by 2 and 4 ranks


@declare_elementwise_optimizer
class DecoupledSGD(torch.optim.Optimizer):
    """Plain SGD over ``decoupled_grad`` (its own ``zero_grad`` is torch's: it never touches
    ``decoupled_grad``, so clearing it is the attached optimizer's job)."""

    use_decoupled_grad = True

    def __init__(self, params: Any, lr: float) -> None:
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        for group in self.param_groups:
            for param in group["params"]:
                grad = getattr(param, "decoupled_grad", None)
                if grad is not None:
                    param.add_(grad, alpha=-group["lr"])


def _full_grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    out = {}
    for name, param in model.named_parameters():
        grad = optimizer_grad(param)
        if grad is not None:
            full = grad.full_tensor() if hasattr(grad, "full_tensor") else grad
            out[name.removeprefix("module.")] = full.detach().clone()
    return out


def _decoupled_worker(rank: int, world: int, strategy: int) -> None:
    (tokens, targets), (tokens2, targets2) = make_batches(2, GLOBAL_BATCH)
    reference = make_model()
    model = FSDPRootWrapper(
        make_model(),
        fsdp_unit_modules=[Block],
        options=ShardingOptions(
            zero_dp_strategy=strategy,
            mixed_precision_policy=MixedPrecisionPolicy(use_decoupled_grad=True),
            sync_model_each_microbatch=False,
        ),
    )
    with pytest.raises(ValueError, match="decoupled_grad"):
        attach_optimizer(torch.optim.SGD(trainable(model), lr=0.1))
    optimizer = attach_optimizer(DecoupledSGD(trainable(model), lr=0.1))

    def backward(model_: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, split: bool) -> None:
        if split:
            x, y = local_slice(x, rank, world), local_slice(y, rank, world)
        loss_fn(model_(x), y).backward()

    # Two backwards without zero_grad: the decoupled gradients add up, as .grad would.
    for x, y in ((tokens, targets), (tokens2, targets2)):
        backward(reference, x, y, split=False)
        backward(model, x, y, split=True)
    for name, param in model.named_parameters():
        if param.requires_grad:
            assert param.grad is None, f"{name}: .grad was set"
            assert isinstance(getattr(param, "decoupled_grad", None), torch.Tensor), name
    want = {n: p.grad for n, p in reference.named_parameters() if p.grad is not None}
    got = _full_grads(model)
    assert got.keys() == want.keys(), (sorted(got), sorted(want))
    for name, grad in want.items():
        assert_close_rel(got[name], grad, 1e-5, f"accumulated {name}")

    optimizer.step()
    torch.optim.SGD(reference.parameters(), lr=0.1).step()
    # zero_grad(set_to_none=False) zeroes in place; the default drops the gradients (and so
    # frees their storage), as torch's does for .grad.
    optimizer.zero_grad(set_to_none=False)
    for name, param in model.named_parameters():
        if param.requires_grad:
            held = param.decoupled_grad  # type: ignore[attr-defined]
            assert not local_tensor(held).any(), f"{name}: not zeroed"
    optimizer.zero_grad()
    for name, param in model.named_parameters():
        assert getattr(param, "decoupled_grad", None) is None, f"{name}: not cleared"
        assert optimizer_grad(param) is None, name
    # A fresh backward after clearing starts from zero, not from the old gradients.
    reference.zero_grad()
    backward(reference, tokens, targets, split=False)
    backward(model, tokens, targets, split=True)
    want = {n: p.grad for n, p in reference.named_parameters() if p.grad is not None}
    got = _full_grads(model)
    for name, grad in want.items():
        assert_close_rel(got[name], grad, 1e-5, f"after zero_grad {name}")


FULL = os.environ.get("MFSDP_FULL_MATRIX") == "1"


@pytest.mark.parametrize(
    "world",
    [2, pytest.param(4, marks=pytest.mark.skipif(not FULL, reason="MFSDP_FULL_MATRIX=1 only"))],
)
@pytest.mark.parametrize(
    "strategy",
    [pytest.param(0, marks=pytest.mark.skipif(not FULL, reason="MFSDP_FULL_MATRIX=1 only")), 3],
)
def test_decoupled_gradients_accumulate_clear_and_refuse_grad_readers(
    strategy: int, world: int
) -> None:
    run_distributed(_decoupled_worker, world, strategy, timeout=180)
