"""The one owner of a root's gradient reductions in flight.

Each unit launches its groups' reductions when its backward is done; the queue keeps them
oldest first and bounds how many are in flight (``max_inflight_reductions``, counted in
reductions, never in elements). Nothing else holds a ``PendingReduction``: a reducer about to
reuse its buffer asks the queue to ``settle`` it first. A timeline trace sees each launch and
each blocking wait through the one ``ReductionObserver`` installed by ``observe_reductions``.
"""

from __future__ import annotations

from collections import deque
from typing import Protocol

from mfsdp_collectives import CommStreams
from mfsdp_hooks.grads.grad_reducer import GradReducer, PendingReduction

__all__ = ["ReductionObserver", "ReductionQueue", "ReductionSpan", "observe_reductions"]


class ReductionSpan(Protocol):
    """One observed launch or wait; ``end()`` when it returns."""

    def end(self) -> None: ...


class ReductionObserver(Protocol):
    """What a trace sees of the queues: a span around each launch (``waiting=False``) and
    each wait for a reduction not yet done (``waiting=True``); None when it ignores it."""

    def reduction_span(
        self, reducer: GradReducer, streams: CommStreams | None, *, waiting: bool
    ) -> ReductionSpan | None: ...


_OBSERVER: ReductionObserver | None = None


def observe_reductions(observer: ReductionObserver | None) -> None:
    """Show every queue's launches and waits to ``observer`` (None: to nobody). One at a time,
    process-wide, as the trace that installs it: autograd may reduce on another thread."""
    global _OBSERVER
    _OBSERVER = observer


class ReductionQueue:
    """In-flight reductions, oldest first. ``overlap=False`` waits for each one at launch;
    ``reap_early`` finishes reductions as soon as they land (off when a pooling allocator
    needs the buffers freed in a fixed order)."""

    def __init__(self, window: int, *, overlap: bool, reap_early: bool) -> None:
        self._window = window
        self._overlap = overlap
        self._reap_early = reap_early
        self._in_flight: deque[PendingReduction] = deque()

    def enqueue(
        self, reducer: GradReducer, streams: CommStreams | None, *, ends_cycle: bool = True
    ) -> None:
        """Start ``reducer``'s reduction and queue it, keeping at most ``window`` in flight."""
        self.settle(reducer)
        observer = _OBSERVER
        span = None
        if observer is not None:
            span = observer.reduction_span(reducer, streams, waiting=False)
        pending = reducer.start_reduction(streams, ends_cycle=ends_cycle)
        if span is not None:
            span.end()
        if not self._overlap:
            self._finish(pending)
            return
        self._in_flight.append(pending)
        while len(self._in_flight) > self._window:
            self._finish(self._in_flight.popleft())

    @staticmethod
    def _finish(pending: PendingReduction) -> None:
        """Wait for ``pending`` (a no-op once done), in the observer's sight when one is."""
        observer = _OBSERVER
        if observer is None or pending.done:
            pending.wait()
            return
        span = observer.reduction_span(pending.reducer, None, waiting=True)
        pending.wait()
        if span is not None:
            span.end()

    def settle(self, reducer: GradReducer) -> None:
        """Finish ``reducer``'s reduction in flight, if any (its buffer is about to be reused)."""
        for pending in self._in_flight:
            if pending.reducer is reducer:
                self._finish(pending)  # stays queued, done: popping it later is a no-op

    def in_flight(self, reducer: GradReducer) -> bool:
        return any(p.reducer is reducer and not p.done for p in self._in_flight)

    def reap_landed(self) -> None:
        """Finish the reductions that already landed, freeing their gradients early (else
        they would live through all of the next unit's backward)."""
        while self._reap_early and self._in_flight and self._in_flight[0].landed():
            self._finish(self._in_flight.popleft())

    def drain(self) -> None:
        """Finish every reduction in flight, oldest first."""
        while self._in_flight:
            self._finish(self._in_flight.popleft())
