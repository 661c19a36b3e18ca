"""The issue's targets, checked against a run's figures (reported, never asserted)."""

from __future__ import annotations

from dataclasses import dataclass

from benchmarks.stats import CellSummary

TIME_TARGET = 0.80
MEMORY_TARGET = 0.77
NO_SLOWER = 1.00
OVERLAP_TARGET = 1.15
HEADLINE = ("default", 2)
"""The cell the time and memory targets are stated for: (config, world size)."""


@dataclass(frozen=True)
class GoalCheck:
    goal: str
    cell: str
    target: float
    measured: float | None
    band: tuple[float, float] | None = None
    """For step-time ratios: (best, worst) over the repetitions' min-max ranges."""

    @property
    def ok(self) -> bool | None:
        return None if self.measured is None else self.measured <= self.target

    @property
    def verdict(self) -> str:
        if self.measured is None:
            return "not measured"
        if self.ok:
            if self.band is not None and self.band[1] > self.target:
                low, high = self.band
                return f"met (but the reps' spread, {low:.2f}-{high:.2f}, reaches past the target)"
            return "met"
        missed = f"missed by {100 * (self.measured / self.target - 1):.0f}%"
        if self.band is not None and self.band[0] <= self.target:
            missed += f" (within the reps' spread, {self.band[0]:.2f}-{self.band[1]:.2f})"
        return missed


def check_goals(cells: list[CellSummary]) -> list[GoalCheck]:
    """One line per (goal, cell) the run covered, headline cells first."""
    checks: list[GoalCheck] = []
    config, world = HEADLINE
    for cell in cells:
        if (cell.config, cell.world_size) != (config, world):
            continue
        checks.append(
            GoalCheck(
                "step time ours/FSDP2",
                cell.key,
                TIME_TARGET,
                cell.ratio("step_s"),
                cell.step_ratio_band(),
            )
        )
        checks.append(
            GoalCheck(
                "peak live-tensor memory ours/FSDP2",
                cell.key,
                MEMORY_TARGET,
                cell.ratio("live_peak_mib"),
            )
        )
    for cell in cells:
        checks.append(
            GoalCheck(
                "no config slower than FSDP2",
                cell.key,
                NO_SLOWER,
                cell.ratio("step_s"),
                cell.step_ratio_band(),
            )
        )
    for cell in cells:
        checks.append(
            GoalCheck(
                "overlap efficiency (ours)",
                cell.key,
                OVERLAP_TARGET,
                cell.overlap_efficiency("ours"),
            )
        )
    return checks
