"""An LR scheduler built before the optimizer is handed to us (issue 49, item 4).

The usual script order is ``optimizer = AdamW(model.parameters()); scheduler =
LambdaLR(optimizer, ...)`` and then the seed's one-line change ``model, optimizer =
fully_shard(model, optimizer)``. Torch's scheduler has by then wrapped ``step`` on the
optimizer instance; the optimizer it holds must stay the one that steps, every LR it sets
must reach the sharded step, and ``scheduler.step()`` must not warn that the optimizer did
not step. Measured against one process training the whole batch: losses, final weights and
the LR sequence over 10 AdamW steps, for ``fully_shard`` (LambdaLR, two param groups) and
``fully_shard_model`` + ``fully_shard_optimizer`` (StepLR).
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
import torch.distributed as dist

from megatron_fsdp import fully_shard, fully_shard_model, fully_shard_optimizer
from mfsdp_collectives.testing import run_distributed
from mfsdp_hooks.testing import Block, local_slice, loss_fn, make_batches, make_model

STEPS = 10


def _param_groups(params: list[torch.nn.Parameter]) -> list[dict[str, Any]]:
    return [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.1},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0, "lr": 3e-3},
    ]


def _schedule(kind: str, optimizer: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LRScheduler:
    if kind == "lambda":
        return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (1 + step))
    return torch.optim.lr_scheduler.StepLR(optimizer, 3, gamma=0.5)


def _train(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    rank: int,
    world: int,
    **step_keywords: bool,
) -> tuple[list[float], list[list[float]], list[str]]:
    losses: list[float] = []
    lrs: list[list[float]] = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for tokens, targets in make_batches(STEPS):
            loss = loss_fn(
                model(local_slice(tokens, rank, world)), local_slice(targets, rank, world)
            )
            loss.backward()
            optimizer.step(**step_keywords)
            optimizer.zero_grad()
            scheduler.step()
            total = loss.detach().clone()
            if world > 1:
                dist.all_reduce(total)
            losses.append(total.item() / world)
            lrs.append([float(lr) for lr in scheduler.get_last_lr()])
    said = [str(w.message) for w in caught if "step()" in str(w.message)]
    return losses, lrs, said


def _weights(model: torch.nn.Module) -> dict[str, list[Any]]:
    # Lists, not tensors: a rank's result must not hold shared memory past its exit.
    return {
        name.removeprefix("module."): (p.full_tensor() if hasattr(p, "full_tensor") else p).tolist()
        for name, p in model.named_parameters()
    }


def _reference() -> dict[str, Any]:
    """One process on the whole batch: LambdaLR over two param groups, and StepLR."""
    found: dict[str, Any] = {}
    for kind in ("lambda", "step"):
        model = make_model()
        params = list(model.parameters())
        optimizer = torch.optim.AdamW(
            _param_groups(params) if kind == "lambda" else params, lr=1e-2
        )
        found[kind] = (*_train(model, optimizer, _schedule(kind, optimizer), 0, 1), _weights(model))
    return found


def _sharded(rank: int, world: int) -> dict[str, Any]:
    found: dict[str, Any] = {}
    # The seed's one-line change, the scheduler built first on the unsharded model's optimizer.
    model = make_model()
    optimizer = torch.optim.AdamW(_param_groups(list(model.parameters())), lr=1e-2)
    scheduler = _schedule("lambda", optimizer)
    sharded, returned = fully_shard(model, optimizer, fsdp_unit_modules=[Block])
    assert returned is optimizer and scheduler.optimizer is optimizer
    seed_keywords = {
        "sync_grad_before_optimizer_step": True,
        "install_optimized_model_weights": True,
    }
    trained = _train(sharded, optimizer, scheduler, rank, world, **seed_keywords)
    found["lambda"] = (*trained, _weights(sharded))
    # The two-call API, the scheduler built on the sharded model's optimizer before attaching.
    wrapper = fully_shard_model(make_model(), fsdp_unit_modules=[Block])
    optimizer = torch.optim.AdamW(wrapper.parameters(), lr=1e-2)
    scheduler = _schedule("step", optimizer)
    assert fully_shard_optimizer(optimizer) is optimizer and scheduler.optimizer is optimizer
    # Not installed after the step: the next forward must install the stepped weights.
    trained = _train(
        wrapper, optimizer, scheduler, rank, world, install_optimized_model_weights=False
    )
    found["step"] = (*trained, _weights(wrapper))
    return found


def test_a_scheduler_built_first_steps_the_sharded_optimizer_as_one_process() -> None:
    want = _reference()
    for got in run_distributed(_sharded, 2, timeout=120):
        for kind, (losses, lrs, said, weights) in got.items():
            ref_losses, ref_lrs, ref_said, ref_weights = want[kind]
            assert said == ref_said == [], (kind, said)
            assert lrs == ref_lrs, kind
            assert len(set(map(tuple, lrs))) > 2, kind  # the schedule did change the LR
            torch.testing.assert_close(
                torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=1e-6
            )
            assert set(weights) == set(ref_weights), kind
            for name, weight in weights.items():
                torch.testing.assert_close(
                    torch.tensor(weight), torch.tensor(ref_weights[name]), rtol=1e-5, atol=1e-6
                )
