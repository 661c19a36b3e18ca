"""Markdown tables of a run: per-implementation figures, comparisons, goals, profile digest."""

from __future__ import annotations

import statistics

from benchmarks.goals import GoalCheck
from benchmarks.stats import MIB, CellSummary, ImplSummary

NAMES = {"ours": "megatron-fsdp", "fsdp2": "FSDP2", "local": "no-comm ref"}


def _f(value: float | None, fmt: str = "{:.0f}") -> str:
    return "-" if value is None else fmt.format(value)


def _comm(s: ImplSummary, kind: str) -> str:
    entry = s.comm.get(kind)
    if not entry:
        # Our shared-memory transport issues no c10d op: take our own tracer's count.
        traced = [v for k, v in s.comm_tracer.items() if k.rsplit("/", 1)[-1] == kind]
        if not traced:
            return "-"
        entry = {f: sum(v[f] for v in traced) for f in ("calls", "bytes")}
    return f"{entry['calls']} / {entry['bytes'] / MIB:.1f}"


def _spread(s: ImplSummary) -> str:
    lo, hi = min(s.step_s_reps), max(s.step_s_reps)
    return f"{1e3 * s.step_s:.0f} ({1e3 * lo:.0f}-{1e3 * hi:.0f})"


def figures_table(cells: list[CellSummary]) -> str:
    """Every implementation in every cell: time, throughput, memory, communication."""
    head = (
        "| config | prec | ws | impl | step ms (min-max) | tok/s | fwd/bwd/opt ms "
        "| peak live MiB | RSS HWM MiB | all-gather calls / MiB | reduce-scatter calls / MiB "
        "| overlap eff |\n|" + "---|" * 12
    )
    rows = [head]
    for c in cells:
        for impl in ("ours", "fsdp2", "local"):
            s = c.impls.get(impl)
            if s is None:
                continue
            phases = "/".join(_f(s.phase_ms.get(p)) for p in ("forward", "backward", "optimizer"))
            eff = c.overlap_efficiency(impl) if impl != "local" else None
            mem = s.live_peak_mib if s.cuda_max_allocated_mib is None else s.cuda_max_allocated_mib
            rows.append(
                f"| {c.config} | {c.precision} | {c.world_size} | {NAMES[impl]} | {_spread(s)} "
                f"| {s.tokens_per_s:,.0f} | {phases} | {_f(mem, '{:.1f}')} "
                f"| {_f(s.rss_timed_hwm_mib)} | {_comm(s, 'all_gather')} "
                f"| {_comm(s, 'reduce_scatter')} | {_f(eff, '{:.2f}')} |"
            )
    return "\n".join(rows)


def _paired(ratios: list[float]) -> str:
    if not ratios:
        return "-"
    return f"{statistics.median(ratios):.2f} ({ratios[0]:.2f}-{ratios[-1]:.2f})"


def ratio_table(cells: list[CellSummary]) -> str:
    """ours/FSDP2 per cell (< 1 is better for us), plus the loss agreement check."""
    rows = [
        "| config | prec | ws | model | step time ours/FSDP2 "
        "| paired per rep: median (min-max) | CPU time/step ours/FSDP2 "
        "| peak live mem ours/FSDP2 "
        "| RSS HWM ours/FSDP2 | overlap eff ours | overlap eff FSDP2 | max abs loss diff |",
        "|" + "---|" * 12,
    ]
    for c in cells:
        rows.append(
            f"| {c.config} | {c.precision} | {c.world_size} | {c.model} "
            f"| {_f(c.ratio('step_s'), '{:.2f}')} | {_paired(c.paired_step_ratios())} "
            f"| {_f(c.ratio('cpu_s'), '{:.2f}')} "
            f"| {_f(c.ratio('live_peak_mib'), '{:.2f}')} "
            f"| {_f(c.ratio('rss_timed_hwm_mib'), '{:.2f}')} "
            f"| {_f(c.overlap_efficiency('ours'), '{:.2f}')} "
            f"| {_f(c.overlap_efficiency('fsdp2'), '{:.2f}')} "
            f"| {_f(c.max_loss_delta(), '{:.1e}')} |"
        )
    return "\n".join(rows)


def memory_phase_table(cells: list[CellSummary]) -> str:
    """Live MiB at the end of each phase (peak during it in brackets), instrumented step."""
    rows = [
        "| config | prec | ws | impl | start | forward | backward | optimizer | zero_grad |",
        "|" + "---|" * 9,
    ]
    for c in cells:
        for impl in ("ours", "fsdp2"):
            s = c.impls.get(impl)
            if s is None or not s.memory_phases:
                continue
            marks = " | ".join(f"{live:.1f} [{peak:.1f}]" for _, live, peak in s.memory_phases)
            rows.append(
                f"| {c.config} | {c.precision} | {c.world_size} | {NAMES[impl]} | {marks} |"
            )
    return "\n".join(rows)


def goals_table(checks: list[GoalCheck]) -> str:
    rows = ["| goal | cell | target | measured | verdict |", "|---|---|---|---|---|"]
    for g in checks:
        mark = {True: "✅", False: "❌", None: "-"}[g.ok]
        rows.append(
            f"| {g.goal} | {g.cell} | ≤ {g.target:.2f} | {_f(g.measured, '{:.2f}')} "
            f"| {mark} {g.verdict} |"
        )
    return "\n".join(rows)


def peak_breakdown_table(cells: list[CellSummary], limit: int = 10) -> str:
    """What is live at each engine's peak, by allocation site, for the headline cells."""
    parts = []
    for c in cells:
        impls = [i for i in ("ours", "fsdp2") if c.impls.get(i) and c.impls[i].peak_by_site_mib]
        if not impls:
            continue
        rows = [
            f"**{c.key}**: "
            + ", ".join(
                f"{NAMES[i]} peak {_f(c.impls[i].live_peak_mib, '{:.1f}')} MiB in "
                f"{c.impls[i].peak_phase}"
                for i in impls
            ),
            "",
            "| allocation site | " + " | ".join(f"{NAMES[i]} MiB" for i in impls) + " |",
            "|---|" + "---|" * len(impls),
        ]
        sites: dict[str, float] = {}
        for i in impls:
            for site, mib in c.impls[i].peak_by_site_mib.items():
                sites[site] = max(sites.get(site, 0.0), mib)
        for site in sorted(sites, key=lambda k: -sites[k])[:limit]:
            vals = [_f(c.impls[i].peak_by_site_mib.get(site), "{:.1f}") for i in impls]
            rows.append(f"| `{site}` | " + " | ".join(vals) + " |")
        parts.append("\n".join(rows))
    return "\n\n".join(parts)
