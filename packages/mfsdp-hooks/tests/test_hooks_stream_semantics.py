"""The engine's overlap paths on simulated streams (``mfsdp_collectives.testing.stream_sim``).

Inside ``simulated_streams()`` the root's ``CommStreams`` get side streams on CPU and the
unchanged engine issues its all-gathers and reduce-scatters on them, as on CUDA; every
tensor op and collective is checked against the order the streams guarantee. The parity
workers of the other test files run inside it unchanged; planted ordering bugs raise.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from hooks_models import Block, local_slice, loss_fn, make_batches, make_model, make_optimizer
from test_hooks_hsdp import hsdp_case
from test_hooks_parity import megatron_case
from test_hooks_strict_async import deep_prefetch_case
from test_hooks_training_modes import _accumulation_worker, _recompute_worker

from mfsdp_collectives.testing import run_distributed
from mfsdp_collectives.testing.stream_sim import SimEvent, StreamOrderError, simulated_streams
from mfsdp_hooks import FSDPRootWrapper, ShardingOptions, fsdp_units
from mfsdp_hooks.testing.parity import ParityCase, parity_worker


def _on_simulated_streams(
    rank: int, world: int, worker: Callable[..., Any], *args: Any
) -> dict[str, int]:
    """Run ``worker`` with simulated streams; report how much each stream issued."""
    with simulated_streams() as simulator:
        worker(rank, world, *args)
    assert simulator.checked > 0
    return {s.name: s.tick for s in simulator.streams}


def _busy_streams(ticks: list[dict[str, int]]) -> set[str]:
    return {name for per_rank in ticks for name, tick in per_rank.items() if tick > 0}


def _each_on_simulated_streams(
    rank: int, world: int, cases: list[list[ParityCase]]
) -> list[dict[str, int]]:
    """Each list of cases on simulated streams of its own: what each list's streams issued."""
    return [_on_simulated_streams(rank, world, parity_worker, each) for each in cases]


def test_parity_on_simulated_streams() -> None:
    # Each strategy through gloo, then on shared memory (a group goes from gloo to shared
    # memory, never back).
    strategies = range(4)
    gloo = [[megatron_case(s, "sgd", transport="gloo")] for s in strategies]
    shm = [[megatron_case(s)] for s in strategies]
    per_rank = run_distributed(_each_on_simulated_streams, 2, gloo + shm, timeout=300)
    for index, strategy in enumerate(strategies):
        ticks = [each[at] for each in per_rank for at in (index, len(gloo) + index)]
        # Gradients are reduced on the reduce-scatter stream (no_shard's all-reduce too), and
        # weights gathered on the all-gather stream (ZeRO-1/2: after the step; no_shard has
        # none): the paths under test really ran there.
        expected = {"compute", "reduce_scatter"} | ({"all_gather"} if strategy else set())
        assert expected <= _busy_streams(ticks), strategy


def test_deep_prefetch_on_simulated_streams() -> None:
    cases = [deep_prefetch_case(2)]
    ticks = run_distributed(_on_simulated_streams, 2, parity_worker, cases, timeout=180)
    assert {"all_gather", "reduce_scatter"} <= _busy_streams(ticks)


@pytest.mark.parametrize(("strategy", "mode"), [(3, "no_sync"), (2, "overlapped")])
def test_accumulation_on_simulated_streams(strategy: int, mode: str) -> None:
    run_distributed(_on_simulated_streams, 2, _accumulation_worker, strategy, mode, timeout=180)


@pytest.mark.parametrize("mode", ["no_sync", "finish"])
def test_hsdp_on_simulated_streams(mode: str) -> None:
    cases = [hsdp_case(2, 3, "megatron", mode)]
    ticks = run_distributed(_on_simulated_streams, 4, parity_worker, cases, timeout=240)
    # The last micro-batch's two-level reduction uses the outer stream for the hop across
    # the replicas; after all-no_sync micro-batches finish_grad_sync's all-reduce of the
    # shard runs on the reduce-scatter stream.
    expected = {"all_gather", "reduce_scatter"} | ({"outer"} if mode == "no_sync" else set())
    assert expected <= _busy_streams(ticks)


def test_recompute_on_simulated_streams() -> None:
    run_distributed(_on_simulated_streams, 2, _recompute_worker, "non_reentrant", timeout=120)


def _planted_order_bug_worker(rank: int, world: int, bug: str) -> str:
    options = ShardingOptions(zero_dp_strategy=3, sync_model_each_microbatch=False)
    model = FSDPRootWrapper(make_model(), fsdp_unit_modules=[Block], options=options)
    optimizer = make_optimizer("sgd", [p for p in model.parameters() if p.requires_grad])
    tokens, targets = make_batches(1, 8)[0]
    local = local_slice(tokens, rank, world), local_slice(targets, rank, world)
    with simulated_streams():
        loss_fn(model(local[0]), local[1]).backward()  # builds the root and its streams
        optimizer.step()
        optimizer.zero_grad()
        streams = fsdp_units(model)[0].root.streams  # type: ignore[union-attr]
        if bug == "gather_before_compute":  # the seeds' PR 003: no wait before the gather
            streams.all_gather.wait_stream = lambda other: None  # type: ignore[method-assign,union-attr]
        else:  # the consumer waits on an event that does not cover the all-gather
            streams.all_gather.record_event = lambda event=None: SimEvent({})  # type: ignore[method-assign,union-attr]
        try:
            loss_fn(model(local[0]), local[1]).backward()
        except StreamOrderError as exc:
            return str(exc)
    return "no error"


@pytest.mark.parametrize(
    ("bug", "says"),
    [
        ("gather_before_compute", "stream 'all_gather' reads a buffer"),
        ("event_too_early", "stream 'compute' reads a buffer"),
    ],
)
def test_a_planted_ordering_bug_raises_naming_the_streams(bug: str, says: str) -> None:
    for message in run_distributed(_planted_order_bug_worker, 2, bug, timeout=120):
        assert says in message, message
