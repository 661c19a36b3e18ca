"""plan_offsets: live intervals never share bytes; pool between the peak and the naive sum."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from mfsdp_buffers import Interval, peak_live_numel, plan_offsets


def _check_plan(intervals: list[Interval], alignment: int) -> int:
    plan = plan_offsets(intervals, alignment)
    assert len(plan.offsets) == len(intervals)
    for i, a in enumerate(intervals):
        assert plan.offsets[i] % alignment == 0
        assert plan.offsets[i] + a.numel <= plan.pool_numel
        for j in range(i + 1, len(intervals)):
            b = intervals[j]
            live_together = a.start < b.end and b.start < a.end
            if live_together and a.numel and b.numel:
                a_lo, b_lo = plan.offsets[i], plan.offsets[j]
                assert a_lo + a.numel <= b_lo or b_lo + b.numel <= a_lo, (i, j)
    naive = sum(-(-iv.numel // alignment) * alignment for iv in intervals)
    assert plan.peak_numel == peak_live_numel(intervals, alignment)
    assert plan.peak_numel <= plan.pool_numel <= naive
    assert plan_offsets(intervals, alignment) == plan  # deterministic
    return plan.pool_numel


@st.composite
def _intervals(draw: st.DrawFn) -> list[Interval]:
    n = draw(st.integers(0, 14))
    out = []
    for _ in range(n):
        start = draw(st.integers(0, 30))
        length = draw(st.integers(1, 12))
        out.append(Interval(start, start + length, draw(st.integers(0, 100))))
    return out


@given(intervals=_intervals(), alignment=st.sampled_from([1, 4, 16]))
def test_random_intervals(intervals: list[Interval], alignment: int) -> None:
    pool = _check_plan(intervals, alignment)
    assert pool <= plan_offsets(intervals, alignment, search_budget=0).pool_numel


def test_disjoint_lifetimes_share_bytes() -> None:
    intervals = [Interval(0, 2, 10), Interval(2, 4, 10), Interval(4, 6, 10)]
    plan = plan_offsets(intervals)
    assert plan.offsets == (0, 0, 0) and plan.pool_numel == 10 == plan.peak_numel


def test_touching_intervals_do_not_overlap() -> None:
    # [0, 2) and [2, 4): the first is freed at time 2, before the second is allocated.
    assert peak_live_numel([Interval(0, 2, 5), Interval(2, 4, 7)]) == 7
    assert peak_live_numel([Interval(0, 3, 5), Interval(2, 4, 7)]) == 12


def test_empty() -> None:
    plan = plan_offsets([])
    assert plan.offsets == () and plan.pool_numel == 0 == plan.peak_numel
