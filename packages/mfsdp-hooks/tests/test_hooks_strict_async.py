"""The engine under strict asynchronous collectives (``mfsdp_collectives.strict_async``).

Every asynchronous collective writes poison into its output until its handle is waited,
raises if a buffer it uses is reused in flight, and released buffers are poisoned: a
missing wait anywhere in the engine becomes NaN in the loss. The parity workers of the
other test files run unchanged inside that mode; two planted bugs show that it catches them.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

import pytest
import torch
from hooks_models import (
    Block,
    full_state,
    local_slice,
    loss_fn,
    make_batches,
    make_model,
    make_optimizer,
    shard_blocks,
    trainable,
)
from test_hooks_hsdp import hsdp_case
from test_hooks_parity import megatron_case, per_module_case
from test_hooks_training_modes import _accumulation_worker, _recompute_worker

from mfsdp_collectives import strict_async
from mfsdp_collectives.testing import run_distributed
from mfsdp_hooks import FSDPRootWrapper, ShardingOptions
from mfsdp_hooks.grads.reduction_queue import ReductionQueue
from mfsdp_hooks.runtime.unit import FSDPUnit
from mfsdp_hooks.testing.parity import ParityCase, parity_worker

STEPS = 10


def _strictly(rank: int, world: int, worker: Callable[..., Any], *args: Any) -> Any:
    with strict_async():
        return worker(rank, world, *args)


@pytest.mark.parametrize("world", [2, 4])
def test_parity_of_every_strategy_under_strict_collectives(world: int) -> None:
    strategies = range(4) if world == 2 else [3]  # 4 ranks: ZeRO-3
    cases = [megatron_case(strategy) for strategy in strategies]
    run_distributed(_strictly, world, parity_worker, cases, timeout=240)


def test_parity_of_both_transports_pooled_buffers_and_the_per_module_api() -> None:
    cases = [
        megatron_case(3, transport="gloo"),
        megatron_case(2, transport="shm"),
        megatron_case(3, allocator="trace_pool"),
        per_module_case(3),
    ]
    run_distributed(_strictly, 2, parity_worker, cases, timeout=240)


@pytest.mark.parametrize(("strategy", "mode"), [(1, "no_sync"), (3, "no_sync"), (2, "overlapped")])
def test_gradient_accumulation_under_strict_collectives(strategy: int, mode: str) -> None:
    run_distributed(_strictly, 2, _accumulation_worker, strategy, mode, timeout=120)


def test_hsdp_under_strict_collectives() -> None:
    cases = [
        hsdp_case(2, 0),
        hsdp_case(2, 3, "megatron", "no_sync"),
        hsdp_case(2, 2, "megatron", "finish"),
    ]
    run_distributed(_strictly, 4, parity_worker, cases, timeout=240)


@pytest.mark.parametrize("mode", ["reentrant", "non_reentrant"])
def test_activation_recompute_under_strict_collectives(mode: str) -> None:
    assert run_distributed(_strictly, 2, _recompute_worker, mode, timeout=120) == [(5, 8)] * 2


def deep_prefetch_case(depth: int) -> ParityCase:
    """The toy model under per-module ``fully_shard`` gathering ``depth`` units ahead."""
    return ParityCase(
        f"prefetch_depth={depth}",
        partial(shard_blocks, prefetch_depth=depth),
        optimizer=partial(make_optimizer, "adamw"),
        batches=partial(make_batches, global_batch=8),
        weights=full_state,
    )


def test_forward_and_backward_prefetch_under_strict_collectives() -> None:
    cases = [deep_prefetch_case(1), deep_prefetch_case(2)]
    run_distributed(_strictly, 2, parity_worker, cases, timeout=180)


def _skip_unshard_waits(unit: FSDPUnit) -> None:
    """A planted bug: use the gathered weights without waiting for the all-gathers."""
    unit._pending_unshard = []
    unit._swap(use_unsharded=True)


def _drop_reductions(queue: ReductionQueue) -> None:
    """A planted bug: end backward without waiting for the gradient reductions."""
    queue._in_flight.clear()


def _planted_bug_worker(rank: int, world: int, bug: str) -> list[bool]:
    if bug == "unshard":
        FSDPUnit.wait_unshard = _skip_unshard_waits  # type: ignore[method-assign]
    else:
        ReductionQueue.drain = _drop_reductions  # type: ignore[method-assign]
    options = ShardingOptions(zero_dp_strategy=3, sync_model_each_microbatch=False)
    model = FSDPRootWrapper(make_model(), fsdp_unit_modules=[Block], options=options)
    optimizer = make_optimizer("sgd", trainable(model))
    nan_losses = []
    with strict_async():
        for tokens, targets in make_batches(2, 8):
            local = local_slice(tokens, rank, world), local_slice(targets, rank, world)
            loss = loss_fn(model(local[0]), local[1])
            nan_losses.append(bool(torch.isnan(loss)))
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
    return nan_losses


@pytest.mark.parametrize(
    ("bug", "expected"),
    [
        ("unshard", [True, True]),  # the first forward already reads poisoned weights
        ("reduce", [False, True]),  # the step used poisoned gradients: the next loss is NaN
    ],
)
def test_a_planted_missing_wait_turns_into_nan_in_the_loss(bug: str, expected: list[bool]) -> None:
    assert run_distributed(_planted_bug_worker, 2, bug, timeout=120) == [expected] * 2
