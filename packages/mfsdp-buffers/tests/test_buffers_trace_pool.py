"""TracePoolAllocator: trace, plan, replay, and safe fallback when an iteration differs."""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import pytest
import torch

from mfsdp_buffers import Interval, TracePhase, TracePoolAllocator, plan_offsets

CPU = torch.device("cpu")
F32 = torch.float32

Event = tuple[str, str, int]  # ("a", name, numel) or ("f", name, 0)

# Unsharded parameter sizes of 4 FSDP units; the unsharded gradient of a unit has
# the same size. Same dtype for both so they compete for one pool.
P = [40, 30, 50, 20]


def _a(name: str) -> Event:
    return ("a", name, P[int(name[1])])


def _f(name: str) -> Event:
    return ("f", name, 0)


# Forward, prefetch depth 1: unit i+1 is gathered before unit i is freed.
FORWARD: list[Event] = [
    _a("P0"), _a("P1"), _f("P0"), _a("P2"), _f("P1"), _a("P3"), _f("P2"), _f("P3"),
]  # fmt: skip
# Backward in reverse, prefetch depth 1, at most 2 gradient reduce-scatters in flight.
BACKWARD: list[Event] = [
    _a("P3"), _a("P2"), _a("G3"), _f("P3"),
    _a("P1"), _a("G2"), _f("P2"),
    _a("P0"), _f("G3"), _a("G1"), _f("P1"),
    _f("G2"), _a("G0"), _f("P0"), _f("G1"), _f("G0"),
]  # fmt: skip
TRAIN = FORWARD + BACKWARD
# Live elements, by hand, at the worst points of the backward:
#   after a(G2): P2 50 + G3 20 + P1 30 + G2 50 = 150
#   after a(G1): G3 freed; P1 30 + G2 50 + P0 40 + G1 30 = 150
# The forward peaks at P1 30 + P2 50 = 80. So the true peak is 150.
TRUE_PEAK = 150
NAIVE = 2 * sum(P) + sum(P)  # params gathered twice, grads once


class Driver:
    """Plays events on an allocator and checks that no live tensor is ever corrupted.

    After every allocation each live tensor holds its own distinct value; every
    event then re-checks all of them, so any byte sharing between two live
    tensors shows up as an overwritten value.
    """

    def __init__(self, allocator: TracePoolAllocator) -> None:
        self.allocator = allocator
        self.live: dict[str, tuple[torch.Tensor, float]] = {}
        self.counter = 0.0
        self.offsets: list[int | None] = []

    def play(self, events: Sequence[Event], *, end: bool = True) -> list[int | None]:
        self.offsets = []
        for kind, name, numel in events:
            if kind == "a":
                assert name not in self.live, name
                t = self.allocator.allocate(name, numel, F32, CPU)
                self.counter += 1.0
                t.fill_(self.counter)
                self.live[name] = (t, self.counter)
                self.offsets.append(self._pool_offset(t))
            else:
                t, _ = self.live.pop(name)
                self.allocator.free(name, t)
            self.check()
        if end:
            self.allocator.end_iteration()
        return self.offsets

    def check(self) -> None:
        for name, (t, value) in self.live.items():
            assert bool((t == value).all()), f"{name} was overwritten"
        ranges = sorted(
            (t.data_ptr(), t.data_ptr() + t.numel() * t.element_size())
            for t, _ in self.live.values()
            if t.numel()
        )
        for (_, hi), (lo, _) in itertools.pairwise(ranges):
            assert hi <= lo, "two live tensors share bytes"

    def _pool_offset(self, t: torch.Tensor) -> int | None:
        pool = self.allocator.pool(F32, CPU)
        if pool is None or t.untyped_storage().data_ptr() != pool.untyped_storage().data_ptr():
            return None
        return (t.data_ptr() - pool.data_ptr()) // t.element_size()


def _phase(allocator: TracePoolAllocator) -> TracePhase:
    """The phase, read through a call so type checkers do not narrow it across events."""
    return allocator.phase


def _planned(**kwargs: int) -> tuple[TracePoolAllocator, Driver]:
    allocator = TracePoolAllocator(**kwargs)
    driver = Driver(allocator)
    assert _phase(allocator) is TracePhase.TRACE
    offsets = driver.play(TRAIN)
    assert offsets == [None] * len(offsets)  # the trace is served by torch.empty
    assert _phase(allocator) is TracePhase.REPLAY
    return allocator, driver


def test_plan_reaches_the_true_peak_of_an_fsdp_trace() -> None:
    allocator, _ = _planned()
    assert allocator.pool_numel(F32, CPU) == TRUE_PEAK
    assert allocator.peak_numel(F32, CPU) == TRUE_PEAK
    assert allocator.planned_peak == TRUE_PEAK == allocator.planned_pool_numel
    assert allocator.naive_numel == NAIVE
    assert allocator.pool_numel(F32, CPU) < allocator.naive_numel
    assert allocator.pool_numel(torch.bfloat16, CPU) == 0


def test_search_beats_greedy_on_the_fsdp_trace() -> None:
    starts: dict[str, tuple[int, int]] = {}
    intervals = []
    for time, (kind, name, numel) in enumerate(TRAIN):
        if kind == "a":
            starts[name] = (time, numel)
        else:
            start, size = starts.pop(name)
            intervals.append(Interval(start, time, size))
    greedy = plan_offsets(intervals, search_budget=0)
    assert greedy.peak_numel == TRUE_PEAK < greedy.pool_numel
    assert plan_offsets(intervals).pool_numel == TRUE_PEAK


def test_replay_serves_every_request_from_the_pool_at_the_same_offsets() -> None:
    allocator, driver = _planned()
    first = driver.play(TRAIN)
    assert None not in first
    pool = allocator.pool(F32, CPU)
    assert pool is not None and pool.numel() == TRUE_PEAK
    for _ in range(3):
        assert driver.play(TRAIN) == first
        assert allocator.pool(F32, CPU) is pool
    assert allocator.fallbacks == 0 and allocator.iteration == 5


def test_forward_only_pass_interleaved_with_training() -> None:
    allocator, driver = _planned()
    planned = driver.play(TRAIN)
    # An evaluation forward and then a training step in the same iteration: the
    # second FORWARD diverges from the trace (the trace expects the backward).
    offsets = driver.play(FORWARD + TRAIN)
    assert None not in offsets[:4]  # the eval forward is a prefix of the trace
    assert offsets[4:] == [None] * (len(offsets) - 4)  # rest of the iteration: torch.empty
    assert allocator.fallbacks == len(offsets) - 4
    # end_iteration resynchronised: the next training step replays the plan again.
    before = allocator.fallbacks
    assert driver.play(TRAIN) == planned and allocator.fallbacks == before
    # An eval pass closed by its own end_iteration is just a prefix of the trace.
    assert driver.play(FORWARD) == planned[:4] and allocator.fallbacks == before


def test_different_sizes_fall_back() -> None:
    allocator, driver = _planned()
    driver.play(TRAIN)
    other = [("a", "P0", 41), ("f", "P0", 0), *TRAIN]
    offsets = driver.play(other)
    assert offsets == [None] * len(offsets)
    assert allocator.fallbacks == len(offsets)


def test_late_free_never_hands_out_live_bytes() -> None:
    allocator, driver = _planned()
    planned = driver.play(TRAIN)
    # P0 is freed only at the end of the forward instead of after P1's gather.
    late = [e for e in FORWARD if e != _f("P0")] + [_f("P0")] + BACKWARD
    offsets = driver.play(late)  # the driver asserts no live tensor is overwritten
    # Requests whose planned bytes overlap the still-live P0 fall back; the rest replay.
    p0_lo = planned[0]
    assert p0_lo is not None and offsets[0] == p0_lo
    state = "before"  # of the forward P0, the one freed late
    got_iter = iter(offsets)
    want_iter = iter(planned)
    for kind, name, numel in late:
        if kind == "f":
            state = "done" if (state, name) == ("live", "P0") else state
            continue
        got, want = next(got_iter), next(want_iter)
        assert want is not None
        clash = state == "live" and want < p0_lo + P[0] and p0_lo < want + numel
        assert got == (None if clash else want), name
        state = "live" if (state, name) == ("before", "P0") else state
    assert allocator.fallbacks >= 1
    assert not allocator.diverged  # the request sequence itself still matched


def test_tensor_kept_past_end_of_iteration() -> None:
    allocator, driver = _planned()
    driver.play(TRAIN)
    # P0 gathered and kept across the iteration boundary (e.g. held by the user).
    driver.play([_a("P0")])
    driver.live["kept"] = driver.live.pop("P0")  # still checked for corruption
    before = allocator.fallbacks
    driver.play(TRAIN)  # its P0 request would reuse the live P0's bytes: falls back
    assert allocator.fallbacks > before
    t, _ = driver.live.pop("kept")
    allocator.free("P0", t)
    before = allocator.fallbacks
    driver.play(TRAIN)
    assert allocator.fallbacks == before


def test_allocations_outliving_the_trace_are_not_pooled() -> None:
    allocator = TracePoolAllocator()
    driver = Driver(allocator)
    driver.play([("a", "keep", 8), *TRAIN])
    assert allocator.naive_numel == NAIVE + 8
    assert allocator.pool_numel(F32, CPU) == TRUE_PEAK
    t, _ = driver.live.pop("keep")
    allocator.free("keep", t)
    offsets = driver.play([("a", "keep", 8), *TRAIN])
    assert offsets[0] is None and None not in offsets[1:]
    assert allocator.fallbacks == 0


def test_separate_pools_per_dtype() -> None:
    allocator = TracePoolAllocator()
    a = allocator.allocate("w", 10, torch.bfloat16, CPU)
    b = allocator.allocate("g", 6, F32, CPU)
    allocator.free("w", a)
    allocator.free("g", b)
    allocator.end_iteration()
    assert allocator.pool_numel(torch.bfloat16, CPU) == 10
    assert allocator.pool_numel(F32, CPU) == 6
    a = allocator.allocate("w", 10, torch.bfloat16, CPU)
    b = allocator.allocate("g", 6, F32, CPU)
    assert a.dtype == torch.bfloat16 and b.dtype == F32
    assert a.untyped_storage().data_ptr() != b.untyped_storage().data_ptr()


def test_alignment() -> None:
    allocator = TracePoolAllocator(alignment=16)
    driver = Driver(allocator)
    driver.play(TRAIN)
    offsets = driver.play(TRAIN)
    assert all(o is not None and o % 16 == 0 for o in offsets)


def test_warmup_then_trace() -> None:
    allocator = TracePoolAllocator(warmup_iterations=1)
    driver = Driver(allocator)
    assert _phase(allocator) is TracePhase.WARMUP
    driver.play(FORWARD)  # first iteration differs; not traced
    assert _phase(allocator) is TracePhase.TRACE and allocator.naive_numel == 0
    driver.play(TRAIN)
    assert _phase(allocator) is TracePhase.REPLAY and allocator.naive_numel == NAIVE


def test_retrace_after_consecutive_divergence() -> None:
    allocator = TracePoolAllocator(retrace_after=2)
    driver = Driver(allocator)
    driver.play(FORWARD)  # a trace that does not match the steady state
    driver.play(TRAIN)
    assert _phase(allocator) is TracePhase.REPLAY
    driver.play(TRAIN)
    assert _phase(allocator) is TracePhase.TRACE  # two diverged iterations: trace again
    driver.play(TRAIN)
    assert allocator.pool_numel(F32, CPU) == TRUE_PEAK
    before = allocator.fallbacks
    assert None not in driver.play(TRAIN) and allocator.fallbacks == before


def test_plan_mid_iteration_and_reset() -> None:
    allocator = TracePoolAllocator()
    driver = Driver(allocator)
    driver.play(TRAIN, end=False)
    allocator.plan()
    assert driver.play(FORWARD) == [None] * 4  # rest of this iteration: not replayed
    assert allocator.fallbacks == 0
    assert None not in driver.play(TRAIN)
    with pytest.raises(RuntimeError, match="TRACE"):
        allocator.plan()
    allocator.reset()
    assert _phase(allocator) is TracePhase.TRACE and allocator.pool(F32, CPU) is None
    driver.play(TRAIN)
    assert None not in driver.play(TRAIN)


def test_misuse() -> None:
    allocator = TracePoolAllocator()
    t = allocator.allocate("k", 4, F32, CPU)
    with pytest.raises(RuntimeError, match="allocated under key"):
        allocator.free("other", t)
    with pytest.raises(RuntimeError, match="not allocated by this allocator"):
        allocator.free("k", torch.empty(4))
    allocator.free("k", t)
    with pytest.raises(RuntimeError, match="not allocated"):
        allocator.free("k", t)
    with pytest.raises(ValueError, match="alignment"):
        TracePoolAllocator(alignment=0)
    with pytest.raises(ValueError, match="warmup_iterations must be >= 0, got -1"):
        TracePoolAllocator(warmup_iterations=-1)
    with pytest.raises(ValueError, match="retrace_after must be >= 1 or None, got 0"):
        TracePoolAllocator(retrace_after=0)
    with pytest.raises(ValueError, match="alignment must be >= 1, got 0"):
        plan_offsets([Interval(0, 1, 4)], alignment=0)
    with pytest.raises(ValueError, match="malformed interval"):
        plan_offsets([Interval(2, 1, 4)])
