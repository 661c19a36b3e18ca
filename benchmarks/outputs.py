"""Everything a run writes: ``table.md``, ``results.json``, the plots, ``RESULTS.md``, and the
summary printed last."""

from __future__ import annotations

import json
import shlex
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from benchmarks.goals import check_goals
from benchmarks.machine import describe
from benchmarks.plots import write_plots
from benchmarks.profile_report import profile_markdown
from benchmarks.report import (
    figures_table,
    goals_table,
    memory_phase_table,
    peak_breakdown_table,
    ratio_table,
)
from benchmarks.results_md import render
from benchmarks.stats import CellSummary, RepResult, as_jsonable, summarize


@dataclass
class Outputs:
    root: Path
    out: Path
    results: list[RepResult]
    failures: list[str]
    speeds: dict[str, dict[str, float]]
    argv: list[str]
    settings: str
    wall_s: float
    cells: list[CellSummary] = field(init=False)

    def __post_init__(self) -> None:
        self.cells = summarize(self.results)

    @property
    def command(self) -> str:
        return " ".join(["python", "benchmarks/run.py", *map(shlex.quote, self.argv)])

    def profiles_markdown(self) -> str:
        by_cell: dict[str, dict[str, dict[str, Any]]] = {}
        for r in self.results:
            s = r.spec
            if r.ranks and r.ranks[0].profile is not None:
                key = f"{s.model.name}/{s.precision}/ws{s.world_size}"
                by_cell.setdefault(key, {})[s.impl] = r.ranks[0].profile
        parts = []
        for key, profiles in by_cell.items():
            cell = next((c for c in self.cells if c.key == key), None)
            ours = cell.impls.get("ours") if cell else None
            comm = ours.comm if ours else {}
            parts.append(profile_markdown(key, profiles, self.speeds.get(key), comm))
        return "\n\n".join(parts)

    def write(self, results_md: Path | None) -> bool:
        """Write all files and print the summary; False when there was nothing to report."""
        cells = self.cells
        checks = check_goals(cells)
        plots = write_plots(cells, self.out) if cells else []
        tables = {
            "goals": goals_table(checks),
            "ours / FSDP2": ratio_table(cells),
            "all figures": figures_table(cells),
            "memory over one step": memory_phase_table(cells),
            "what is live at the peak": peak_breakdown_table(
                [c for c in cells if c.world_size == min(x.world_size for x in cells)]
            )
            if cells
            else "",
        }
        profile = self.profiles_markdown()
        body = "\n\n".join(f"## {k}\n\n{v}" for k, v in tables.items())
        (self.out / "table.md").write_text(
            body + (f"\n\n## profile\n\n{profile}" if profile else "") + "\n"
        )
        machine = describe(self.root, self.results[0].spec.device_type if self.results else "cpu")
        record = {
            "command": self.command,
            "machine": machine,
            "settings": self.settings,
            "wall_s": self.wall_s,
            "cells": cells,
            "goals": [
                {
                    "goal": g.goal,
                    "cell": g.cell,
                    "target": g.target,
                    "measured": g.measured,
                    "verdict": g.verdict,
                }
                for g in checks
            ],
            "collective_speed": self.speeds,
            "worlds": self.results,
            "failures": self.failures,
        }
        (self.out / "results.json").write_text(json.dumps(as_jsonable(record), indent=1))
        if results_md is not None and cells:
            results_md.write_text(
                render(
                    path=results_md,
                    machine=machine,
                    command=self.command,
                    settings=self.settings,
                    wall_s=self.wall_s,
                    goals=tables["goals"],
                    ratios=tables["ours / FSDP2"],
                    figures=tables["all figures"],
                    memory=tables["memory over one step"],
                    breakdown=tables["what is live at the peak"],
                    plots=plots,
                    profile=profile,
                    out_dir=self.out,
                )
            )
        self._print_summary(checks, plots, results_md if cells else None)
        return bool(cells)

    def _print_summary(self, checks: list[Any], plots: list[Path], results_md: Path | None) -> None:
        def fmt(v: float | None, suffix: str = "x") -> str:
            return "  -  " if v is None else f"{v:.2f}{suffix}"

        print("\n== summary: ours/FSDP2 (< 1 is better) ==")
        for c in self.cells:
            print(
                f"{c.key:20s} step time {fmt(c.ratio('step_s'))}  CPU time "
                f"{fmt(c.ratio('cpu_s'))}  peak live mem "
                f"{fmt(c.ratio('live_peak_mib'))}  overlap efficiency ours "
                f"{fmt(c.overlap_efficiency('ours'), '')} / FSDP2 "
                f"{fmt(c.overlap_efficiency('fsdp2'), '')}"
            )
        met = [g for g in checks if g.ok]
        missed = [g for g in checks if g.ok is False]
        print(f"goals met: {len(met)}/{len(checks)}")
        for g in missed:
            print(
                f"  missed: {g.goal} @ {g.cell}: {g.measured:.2f} vs <= {g.target:.2f} "
                f"({g.verdict})"
            )
        written = [self.out / "table.md", self.out / "results.json", *plots]
        if results_md is not None:
            written.append(results_md)
        print(f"wrote {', '.join(str(p) for p in written)}")
        print(f"whole run: {self.wall_s / 60:.1f} min; command: {self.command}")
        for failure in self.failures:
            print(f"FAILED: {failure.splitlines()[0]}")
