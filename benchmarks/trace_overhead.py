"""What ``megatron_fsdp.trace`` costs, and whether its shares add up to the step.

    python -m benchmarks.trace_overhead                     # 2 gloo ranks, spawned here
    torchrun --standalone --nproc-per-node 2 -m benchmarks.trace_overhead

A small GPT (``benchmarks/model.py``; ZeRO-3 per-module ``fully_shard`` on each block and
the root, AdamW attached as ``fully_shard_optimizer`` does) trains in alternating rounds,
tracing off then on, so drift on a shared machine hits both alike. Each step is timed on
the host around forward, backward and ``optimizer.step()`` (after a barrier). Rank 0 prints:

* step time off and on (medians over the rounds' steps) and their ratio;
* the traced steps' shares (compute, exposed all-gather, exposed reduce, optimizer,
  other), which must add up to the timeline's step exactly, and how much of the measured
  step the timeline's step covers (it starts at the root's forward, so a few microseconds
  of the measured step lie before it);
* the cost of tracing off: how many times a step reads ``timeline.ACTIVE`` (counted) times
  what one read costs (timed), against the step.
"""

from __future__ import annotations

import argparse
import importlib
import os
import statistics
import time
import timeit
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist

from benchmarks.configs import ModelConfig
from benchmarks.model import GPT, loss_fn, make_batch
from megatron_fsdp import Timeline, trace
from mfsdp_collectives import disable_host_transport
from mfsdp_collectives.testing import run_distributed
from mfsdp_hooks import (
    HOST_CATEGORIES,
    TimelineRecorder,
    attach_optimizer,
    fully_shard,
    record_timeline,
)

MODEL = ModelConfig("trace", width=256, depth=4, heads=4, seq=128, batch=4)
# The module that holds the switch every instrumentation point reads (``ACTIVE``). Code
# outside layer 3 imports only its public names; this benchmark counts the engine's reads
# of the switch, so it reaches the module through the recorder's.
timeline_module: Any = importlib.import_module(TimelineRecorder.__module__)


def _build(cfg: ModelConfig) -> tuple[GPT, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = GPT(cfg)
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    optimizer = attach_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-3))
    return model, optimizer


def _step(model: GPT, optimizer: torch.optim.Optimizer, batch: tuple[torch.Tensor, ...]) -> float:
    """One training step's host milliseconds (zero_grad left outside, as the timeline does)."""
    dist.barrier()
    start = time.perf_counter_ns()
    loss_fn(model(batch[0]), batch[1]).backward()  # type: ignore[no-untyped-call]
    optimizer.step()
    elapsed = time.perf_counter_ns() - start
    optimizer.zero_grad()
    return elapsed / 1e6


@contextmanager
def _counting_reads() -> Iterator[list[int]]:
    """Count reads of ``timeline.ACTIVE`` from other modules (PEP 562: a module attribute
    that is missing goes to the module's ``__getattr__``) while tracing is off."""
    reads = [0]

    def read(name: str) -> Any:
        if name != "ACTIVE":
            raise AttributeError(name)
        reads[0] += 1
        return None

    del timeline_module.ACTIVE
    timeline_module.__getattr__ = read
    try:
        yield reads
    finally:
        del timeline_module.__getattr__
        timeline_module.ACTIVE = None


def _read_cost_ns() -> float:
    """One off-path check as the engine does it: a module attribute read and a None test."""
    number = 200_000
    seconds = min(
        timeit.repeat(
            "timeline.ACTIVE is not None", globals={"timeline": timeline_module}, number=number
        )
    )
    return seconds / number * 1e9


class _Probe:
    """A stand-in unit: what the recorder reads of one (a name, no parameter groups)."""

    def __init__(self) -> None:
        self.name = "Probe"
        self.groups: list[Any] = []


def _span_cost_ns(spans: int = 20_000) -> float:
    """What one recorded span (open and close, profiler range included) costs the host."""
    unit: Any = _Probe()
    with record_timeline([unit]) as recorder:
        recorder.forward_begins(unit, root=True, recompute=False)
        start = time.perf_counter_ns()
        for _ in range(spans):
            recorder.backward_begins(unit)
            recorder.backward_ends(unit)
        elapsed = time.perf_counter_ns() - start
    return elapsed / spans


def _shares(timeline: Timeline) -> dict[str, float]:
    """The traced steps' shares of the timeline's step, and the exactness of their sum."""
    steps = timeline.steps
    total = sum(step.duration_ns for step in steps)
    sums = {c: sum(step.host_time()[c] for step in steps) for c in HOST_CATEGORIES}
    gap = max(abs(sum(step.host_time().values()) - step.duration_ns) for step in steps)
    return {**{c: ns / total for c, ns in sums.items()}, "gap_ns": gap, "total_ns": total}


def _worker(rank: int, world: int, rounds: int, steps: int) -> dict[str, Any]:
    torch.set_num_threads(1)
    model, optimizer = _build(MODEL)
    batch = make_batch(MODEL, rank, torch.device("cpu"))
    for _ in range(2):  # execution order, optimizer state, the host transport's buffers
        _step(model, optimizer, batch)
    with _counting_reads() as reads:
        _step(model, optimizer, batch)
    off: list[float] = []
    on: list[float] = []
    paired: list[float] = []
    covered: list[float] = []
    last: Timeline | None = None
    for _ in range(rounds):
        plain = [_step(model, optimizer, batch) for _ in range(steps)]
        with trace(model, optimizer) as timeline:
            measured = [_step(model, optimizer, batch) for _ in range(steps)]
        off += plain
        on += measured
        paired.append(statistics.median(measured) / statistics.median(plain))
        covered += [s.duration_ns / 1e6 / m for s, m in zip(timeline.steps, measured, strict=True)]
        last = timeline
    assert last is not None
    return {
        "off": off,
        "on": on,
        "paired": paired,
        "covered": covered,
        "shares": _shares(last),
        "reads": reads[0],
        "read_ns": _read_cost_ns(),
        "report": str(last.overlap_report()),
        "spans": statistics.median(
            sum(e.kind.category is not None for e in step.events) for step in last.steps
        ),
        "span_ns": _span_cost_ns(),
    }


def _print(result: dict[str, Any], world: int) -> None:
    off, on = statistics.median(result["off"]), statistics.median(result["on"])
    shares = result["shares"]
    parts = " + ".join(f"{c} {100 * shares[c]:.1f}%" for c in HOST_CATEGORIES)
    off_cost_us = result["reads"] * result["read_ns"] / 1000
    print(f"GPT {MODEL.describe()}, {world} gloo ranks, ZeRO-3, rank 0")
    paired = result["paired"]
    print(
        f"step time: off {off:.1f} ms (min {min(result['off']):.1f}), on {on:.1f} ms "
        f"(min {min(result['on']):.1f}): on/off {on / off:.3f}x; per round (on/off medians) "
        f"median {statistics.median(paired):.3f}x, range {min(paired):.3f}-{max(paired):.3f}x"
    )
    print(f"timeline step / measured step: median {statistics.median(result['covered']):.4f}")
    print(f"shares of the timeline step: {parts} (largest |sum - step|: {shares['gap_ns']} ns)")
    print(
        f"tracing off: {result['reads']} reads of timeline.ACTIVE per step x "
        f"{result['read_ns']:.0f} ns = {off_cost_us:.1f} us ({100 * off_cost_us / 1000 / off:.4f}% "
        "of a step)"
    )
    on_cost_ms = result["spans"] * result["span_ns"] / 1e6
    print(
        f"tracing on: {result['spans']:.0f} spans per step x {result['span_ns'] / 1000:.1f} us "
        f"= {on_cost_ms:.2f} ms ({100 * on_cost_ms / off:.2f}% of a step)"
    )
    print(result["report"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=10, help="off/on round pairs")
    parser.add_argument("--steps", type=int, default=4, help="steps per round")
    args = parser.parse_args()
    if "LOCAL_RANK" in os.environ:  # under torchrun: this process is one rank
        dist.init_process_group("gloo")
        rank, world = dist.get_rank(), dist.get_world_size()
        result = _worker(rank, world, args.rounds, args.steps)
        if rank == 0:
            _print(result, world)
        disable_host_transport()
        dist.destroy_process_group()
        return
    results = run_distributed(_worker, 2, args.rounds, args.steps, timeout=900)
    _print(results[0], 2)


if __name__ == "__main__":
    main()
