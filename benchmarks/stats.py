"""From per-rank, per-rep raw results to the figures the report shows.

Conventions, chosen so one slow rank or one noisy repetition cannot flatter either engine:

* a step's time is the slowest rank's time for that step (the world waits for it);
* a repetition's step time is the median over its measured steps;
* a cell's step time is the median over repetitions (min and max are kept for error bars);
* memory is per rank: the report shows the largest rank's figure.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import Any

from benchmarks.configs import RunSpec
from benchmarks.worker import PHASES, RankResult

MIB = 2**20


@dataclass
class RepResult:
    """One world (one repetition of one implementation) as the parent received it."""

    spec: RunSpec
    rep: int
    ranks: list[RankResult]
    wall_s: float


@dataclass
class ImplSummary:
    impl: str
    step_s: float
    step_s_reps: list[float]
    tokens_per_s: float
    phase_ms: dict[str, float]
    cpu_s: float | None = None
    live_peak_mib: float | None = None
    live_run_peak_mib: float | None = None
    memory_phases: list[tuple[str, float, float]] = field(default_factory=list)
    peak_phase: str = ""
    peak_by_site_mib: dict[str, float] = field(default_factory=dict)
    rss_lifetime_mib: float | None = None
    rss_timed_hwm_mib: float | None = None
    cuda_max_allocated_mib: float | None = None
    cuda_max_reserved_mib: float | None = None
    comm: dict[str, dict[str, int]] = field(default_factory=dict)
    comm_tracer: dict[str, dict[str, int]] = field(default_factory=dict)
    losses: list[float] = field(default_factory=list)


@dataclass
class CellSummary:
    """One (config, precision, world size): every implementation and the comparisons."""

    config: str
    precision: str
    world_size: int
    model: str
    impls: dict[str, ImplSummary]

    def ratio(self, attr: str, num: str = "ours", den: str = "fsdp2") -> float | None:
        a, b = self.impls.get(num), self.impls.get(den)
        if a is None or b is None:
            return None
        x, y = getattr(a, attr), getattr(b, attr)
        if x is None or y is None or y == 0:
            return None
        return float(x) / float(y)

    def paired_step_ratios(self) -> list[float]:
        """ours/FSDP2 step time within each repetition, sorted.

        The two worlds of a repetition run back to back, so a ratio taken inside one
        repetition cancels the drift of the machine's speed between repetitions, which on a
        shared box is larger than the effects measured.
        """
        a, b = self.impls.get("ours"), self.impls.get("fsdp2")
        if a is None or b is None:
            return []
        pairs = zip(a.step_s_reps, b.step_s_reps, strict=False)
        return sorted(x / y for x, y in pairs if y > 0)

    def step_ratio_band(self) -> tuple[float, float] | None:
        """The widest ours/FSDP2 step-time ratio the repetitions allow: (best, worst)."""
        a, b = self.impls.get("ours"), self.impls.get("fsdp2")
        if a is None or b is None or not a.step_s_reps or not b.step_s_reps:
            return None
        if min(b.step_s_reps) <= 0:
            return None
        return (
            min(a.step_s_reps) / max(b.step_s_reps),
            max(a.step_s_reps) / min(b.step_s_reps),
        )

    def overlap_efficiency(self, impl: str) -> float | None:
        return self.ratio("step_s", impl, "local")

    def max_loss_delta(self) -> float | None:
        """Largest |loss difference| per step between ours and FSDP2 in the same repetition."""
        a, b = self.impls.get("ours"), self.impls.get("fsdp2")
        if a is None or b is None or not a.losses or not b.losses:
            return None
        return max(abs(x - y) for x, y in zip(a.losses, b.losses, strict=False))

    @property
    def key(self) -> str:
        return f"{self.config}/{self.precision}/ws{self.world_size}"


def _rep_step_time(ranks: list[RankResult]) -> float:
    per_step = [max(times) for times in zip(*(r.step_times for r in ranks), strict=True)]
    return float(statistics.median(per_step))


def _rep_cpu_time(ranks: list[RankResult]) -> float | None:
    """Median over steps of the mean CPU seconds a rank spends on one step."""
    series = [r.cpu_times for r in ranks]
    if not all(series):
        return None
    return float(statistics.median(statistics.fmean(v) for v in zip(*series, strict=True)))


def _rep_phase_ms(ranks: list[RankResult]) -> dict[str, float]:
    out: dict[str, float] = {}
    for phase in PHASES:
        series = [r.phase_times.get(phase, []) for r in ranks]
        if not all(series):
            continue
        out[phase] = 1e3 * statistics.median(max(v) for v in zip(*series, strict=True))
    return out


def _mib(value: float | None) -> float | None:
    return None if value is None else value / MIB


def summarize_impl(reps: list[RepResult]) -> ImplSummary:
    """Aggregate the repetitions of one implementation in one cell."""
    timed = [r for r in reps if r.ranks and r.ranks[0].step_times]
    steps = [_rep_step_time(r.ranks) for r in timed]
    phases_per_rep = [_rep_phase_ms(r.ranks) for r in timed]
    spec = reps[0].spec
    step_s = statistics.median(steps)
    summary = ImplSummary(
        impl=spec.impl,
        step_s=step_s,
        step_s_reps=steps,
        tokens_per_s=spec.world_size * spec.model.tokens_per_rank / step_s,
        phase_ms={
            p: statistics.median(d[p] for d in phases_per_rep if p in d)
            for p in PHASES
            if any(p in d for d in phases_per_rep)
        },
    )
    cpu = [c for c in (_rep_cpu_time(r.ranks) for r in timed) if c is not None]
    summary.cpu_s = statistics.median(cpu) if cpu else None
    rss = [max(rank.rss_lifetime_max_kib for rank in r.ranks) / 1024 for r in timed]
    summary.rss_lifetime_mib = statistics.median(rss) if rss else None
    hwm = [
        max(rank.rss_timed_high_water_kib or 0 for rank in r.ranks) / 1024
        for r in timed
        if all(rank.rss_timed_high_water_kib is not None for rank in r.ranks)
    ]
    summary.rss_timed_hwm_mib = statistics.median(hwm) if hwm else None
    cuda = [r for r in timed if r.ranks[0].cuda_max_allocated is not None]
    if cuda:
        summary.cuda_max_allocated_mib = _mib(
            statistics.median(max(k.cuda_max_allocated or 0 for k in r.ranks) for r in cuda)
        )
        summary.cuda_max_reserved_mib = _mib(
            statistics.median(max(k.cuda_max_reserved or 0 for k in r.ranks) for r in cuda)
        )
    instrumented = [r for r in reps if r.ranks and r.ranks[0].memory is not None]
    if instrumented:
        ranks = instrumented[0].ranks
        worst = max(ranks, key=lambda k: k.memory.step_peak if k.memory else 0)
        assert worst.memory is not None
        summary.live_peak_mib = worst.memory.step_peak / MIB
        summary.live_run_peak_mib = max(k.memory.run_peak for k in ranks if k.memory) / MIB
        summary.memory_phases = [
            (n, live / MIB, peak / MIB) for n, live, peak in worst.memory.phases
        ]
        summary.peak_phase = worst.memory.peak_phase
        summary.peak_by_site_mib = {
            site: b / MIB
            for site, b in sorted(worst.memory.peak_by_site.items(), key=lambda kv: -kv[1])
        }
        summary.comm = ranks[0].comm
        summary.comm_tracer = ranks[0].comm_tracer
    first = min(reps, key=lambda r: r.rep)
    summary.losses = first.ranks[0].losses if first.ranks else []
    return summary


def summarize(results: list[RepResult]) -> list[CellSummary]:
    """Group worlds by cell (in first-run order) and summarise each implementation."""
    cells: dict[tuple[str, str, int], dict[str, list[RepResult]]] = {}
    for result in results:
        s = result.spec
        if s.profile_dir is not None:
            continue
        key = (s.model.name, s.precision, s.world_size)
        cells.setdefault(key, {}).setdefault(s.impl, []).append(result)
    out = []
    for (config, precision, world), by_impl in cells.items():
        model = next(iter(by_impl.values()))[0].spec.model.describe()
        impls = {impl: summarize_impl(reps) for impl, reps in by_impl.items()}
        out.append(CellSummary(config, precision, world, model, impls))
    return out


def as_jsonable(obj: Any) -> Any:
    """dataclasses/tuples to plain JSON values (floats rounded for readable diffs)."""
    from dataclasses import asdict, is_dataclass

    if is_dataclass(obj) and not isinstance(obj, type):
        return as_jsonable(asdict(obj))
    if isinstance(obj, dict):
        return {str(k): as_jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [as_jsonable(v) for v in obj]
    if isinstance(obj, float):
        return round(obj, 6)
    return obj
