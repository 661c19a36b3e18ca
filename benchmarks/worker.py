"""What every rank of a benchmark world runs: build, (instrument), time, report.

The order inside one world is fixed so that instrumentation can never leak into timings:

1. under the memory probe: build and wrap the model, take ``instrument_warmup`` steps (lazy
   initialisation, first-iteration order recording), then one step with phase marks and the
   collective counter open;
2. with every instrument closed: ``warmup`` untimed steps, then ``steps`` timed ones.

A rank returns a ``RankResult`` (plain data, picklable) and the parent aggregates them.
"""

from __future__ import annotations

import contextlib
import itertools
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from benchmarks.comm_count import CollectiveCounter
from benchmarks.configs import RunSpec
from benchmarks.impls import Trainer, build
from benchmarks.memory_probe import (
    make_probe,
    reset_rss_high_water,
    rss_high_water_kib,
    rss_lifetime_max_kib,
)
from benchmarks.model import make_batch

PHASES = ("forward", "backward", "optimizer", "zero_grad")


@dataclass
class MemoryReport:
    """Memory over one steady-state step (bytes), from the instrumented step."""

    phases: list[tuple[str, int, int]]
    """``(phase, live at its end, peak during it)``, starting with ``("start", live, live)``."""
    step_peak: int
    run_peak: int
    """Peak since the tracker opened, model construction included."""
    peak_phase: str = ""
    peak_by_site: dict[str, int] = field(default_factory=dict)
    """Live bytes per allocation site at the step's peak (CPU tracker only)."""


@dataclass
class RankResult:
    rank: int
    step_times: list[float] = field(default_factory=list)
    cpu_times: list[float] = field(default_factory=list)
    """Process CPU seconds per timed step: every thread of the rank (compute, gloo, shm)."""
    phase_times: dict[str, list[float]] = field(default_factory=dict)
    losses: list[float] = field(default_factory=list)
    memory: MemoryReport | None = None
    rss_lifetime_max_kib: int = 0
    rss_timed_high_water_kib: int | None = None
    cuda_max_allocated: int | None = None
    cuda_max_reserved: int | None = None
    comm: dict[str, dict[str, int]] = field(default_factory=dict)
    comm_tracer: dict[str, dict[str, int]] = field(default_factory=dict)
    profile: dict[str, Any] | None = None


def _device(rank: int, spec: RunSpec) -> torch.device:
    if spec.device_type == "cuda":
        index = rank % torch.cuda.device_count()
        torch.cuda.set_device(index)
        return torch.device("cuda", index)
    return torch.device(spec.device_type)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class _Step:
    """One training step with a callback at every phase boundary."""

    def __init__(self, trainer: Trainer, batch: tuple[torch.Tensor, ...]) -> None:
        self.trainer = trainer
        self.x, self.y = batch

    def run(self, boundary: Callable[[str], object] | None = None) -> float:
        loss = self.trainer.forward(self.x, self.y)
        if boundary is not None:
            boundary("forward")
        self.trainer.backward(loss)
        if boundary is not None:
            boundary("backward")
        self.trainer.step()
        if boundary is not None:
            boundary("optimizer")
        self.trainer.zero_grad()
        if boundary is not None:
            boundary("zero_grad")
        return float(loss.detach().item())


@contextlib.contextmanager
def _our_tracer(spec: RunSpec) -> Iterator[Any]:
    if spec.impl != "ours":
        yield None
        return
    from mfsdp_collectives import CommTracer

    with CommTracer() as tracer:
        yield tracer


def _instrumented(spec: RunSpec, rank: int, device: torch.device, out: RankResult) -> _Step:
    """Build under the memory probe, warm up, then one step with phase marks and comm counts."""
    with make_probe(device) as probe:
        step = _Step(
            build(spec, rank, device), make_batch(spec.model, spec.data_rank(rank), device)
        )
        for _ in range(spec.instrument_warmup):
            out.losses.append(step.run())
        probe.reset_phase()
        start = probe.mark("start")
        with CollectiveCounter() as counter, _our_tracer(spec) as tracer:
            out.losses.append(step.run(probe.mark))
        out.comm = counter.summary()
        if tracer is not None:
            out.comm_tracer = tracer.summary()
        marks = [m for m in probe.marks if m.name != "start"]
        top = max(marks, key=lambda m: m.peak)
        # The shared-memory mailboxes are mapped, not allocated by torch: the tracker cannot
        # see them, so their bytes are added to every figure of ours, at every phase.
        staged = _transport_staging_bytes(step.trainer.model) if device.type == "cpu" else 0
        by_site = dict(top.peak_by_site or {})
        if staged:
            by_site[STAGING_SITE] = staged
        out.memory = MemoryReport(
            phases=[(start.name, start.live + staged, start.live + staged)]
            + [(m.name, m.live + staged, m.peak + staged) for m in marks],
            step_peak=top.peak + staged,
            run_peak=probe.peak + staged,
            peak_phase=top.name,
            peak_by_site=by_site,
        )
    return step


STAGING_SITE = "mfsdp_collectives/host/shm.py:mailbox"


def _transport_staging_bytes(model: torch.nn.Module) -> int:
    """Bytes of this rank's shared-memory mailboxes (0 for FSDP2 and the reference)."""
    from mfsdp_collectives import host_transport_of
    from mfsdp_hooks import fsdp_units

    groups = {
        id(u.options.topology.shard_group): u.options.topology.shard_group
        for u in fsdp_units(model)
    }
    transports = {id(t): t for t in map(host_transport_of, groups.values()) if t is not None}
    return sum(t.mapped_bytes for t in transports.values())


class _PhaseClock:
    """Wall-clock stamps at the start of a step and at each phase boundary."""

    def __init__(self) -> None:
        self.stamps: list[float] = []

    def start(self) -> None:
        self.stamps = [time.perf_counter()]

    def boundary(self, _phase: str) -> None:
        self.stamps.append(time.perf_counter())


def _timed(spec: RunSpec, step: _Step, device: torch.device, out: RankResult) -> None:
    dist.barrier()
    reset_rss_high_water()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    out.phase_times = {p: [] for p in PHASES}
    for index in range(spec.warmup + spec.steps):
        clock = _PhaseClock()
        _sync(device)
        clock.start()
        cpu_start = time.process_time()
        loss = step.run(clock.boundary)
        _sync(device)
        clock.stamps[-1] = time.perf_counter()
        cpu_s = time.process_time() - cpu_start
        out.losses.append(loss)
        if index >= spec.warmup:
            out.step_times.append(clock.stamps[-1] - clock.stamps[0])
            out.cpu_times.append(cpu_s)
            for phase, (begin, end) in zip(PHASES, itertools.pairwise(clock.stamps), strict=True):
                out.phase_times[phase].append(end - begin)
    out.rss_timed_high_water_kib = rss_high_water_kib()
    if device.type == "cuda":
        out.cuda_max_allocated = torch.cuda.max_memory_allocated(device)
        out.cuda_max_reserved = torch.cuda.max_memory_reserved(device)


def bench_rank(rank: int, world: int, spec: RunSpec) -> RankResult:
    """Entry point of one rank (``mfsdp_collectives.testing.run_distributed`` calls it)."""
    if world != spec.world_size:
        raise ValueError(f"world has {world} ranks but spec.world_size={spec.world_size}")
    device = _device(rank, spec)
    out = RankResult(rank=rank)
    if spec.profile_dir is not None:
        from benchmarks.labels import install_labels

        install_labels(spec.impl)  # before wrapping: engines capture hooks at wrap time
    if spec.instrument:
        step = _instrumented(spec, rank, device, out)
    else:
        step = _Step(
            build(spec, rank, device), make_batch(spec.model, spec.data_rank(rank), device)
        )
    if spec.profile_dir is not None:
        from benchmarks.profiling import profile_steps

        out.profile = profile_steps(spec, rank, step.run, device)
    else:
        _timed(spec, step, device, out)
    out.rss_lifetime_max_kib = rss_lifetime_max_kib()
    return out
