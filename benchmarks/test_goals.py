"""The goal verdicts say when a miss, or a hit, is inside the repetitions' own spread."""

from __future__ import annotations

from benchmarks.goals import check_goals
from benchmarks.stats import CellSummary, ImplSummary


def _impl(name: str, reps: list[float]) -> ImplSummary:
    ordered = sorted(reps)
    return ImplSummary(name, ordered[len(ordered) // 2], reps, 1.0, {})


def _cell(ours: list[float], fsdp2: list[float]) -> CellSummary:
    impls = {"ours": _impl("ours", ours), "fsdp2": _impl("fsdp2", fsdp2)}
    return CellSummary("compute", "fp32", 4, "m", impls)


def _no_slower(cell: CellSummary) -> str:
    checks = [g for g in check_goals([cell]) if g.goal == "no config slower than FSDP2"]
    assert len(checks) == 1
    return checks[0].verdict


def test_a_miss_inside_the_spread_says_so_with_the_range() -> None:
    verdict = _no_slower(_cell([0.93, 1.00, 1.13], [0.93, 0.99, 1.06]))
    assert verdict == "missed by 1% (within the reps' spread, 0.88-1.22)"


def test_a_hit_inside_the_spread_says_so_with_the_range() -> None:
    verdict = _no_slower(_cell([0.80, 0.85, 0.95], [0.90, 1.00, 1.05]))
    assert verdict == "met (but the reps' spread, 0.76-1.06, reaches past the target)"


def test_paired_ratios_divide_within_each_repetition() -> None:
    cell = _cell([1.0, 2.0, 3.0], [2.0, 2.0, 2.0])
    assert cell.paired_step_ratios() == [0.5, 1.0, 1.5]
    only_ours = CellSummary("compute", "fp32", 4, "m", {"ours": _impl("ours", [1.0])})
    assert only_ours.paired_step_ratios() == []


def test_a_clear_miss_and_a_clear_hit_carry_no_spread_note() -> None:
    assert _no_slower(_cell([1.30, 1.31, 1.32], [1.00, 1.01, 1.02])) == "missed by 30%"
    assert _no_slower(_cell([0.90, 0.91, 0.92], [1.00, 1.01, 1.02])) == "met"
