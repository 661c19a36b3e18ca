"""The one owner of a root's gradient reductions in flight.

Each unit launches its groups' reductions when its backward is done; the queue keeps them
oldest first and bounds how many are in flight (``max_inflight_reductions``, counted in
reductions, never in elements), so the gradients of at most that many groups are alive
beyond the one being computed. Nothing else holds a ``PendingReduction``: a reducer about to
reuse its buffer asks the queue to ``settle`` it first.
"""

from __future__ import annotations

from collections import deque

from mfsdp_collectives import CommStreams
from mfsdp_hooks.grads.grad_reducer import GradReducer, PendingReduction

__all__ = ["ReductionQueue"]


class ReductionQueue:
    """In-flight reductions, oldest first. ``overlap=False`` waits for each one at launch;
    ``reap_early`` finishes reductions as soon as they land (off when a pooling allocator
    needs the buffers freed in a fixed order)."""

    def __init__(self, window: int, *, overlap: bool, reap_early: bool) -> None:
        self._window = window
        self._overlap = overlap
        self._reap_early = reap_early
        self._in_flight: deque[PendingReduction] = deque()

    def launch(
        self, reducer: GradReducer, streams: CommStreams | None, *, ends_cycle: bool = True
    ) -> None:
        """Launch ``reducer``'s reduction, keeping at most ``window`` in flight."""
        self.settle(reducer)
        pending = reducer.launch(streams, ends_cycle=ends_cycle)
        if not self._overlap:
            pending.wait()
            return
        self._in_flight.append(pending)
        while len(self._in_flight) > self._window:
            self._in_flight.popleft().wait()

    def settle(self, reducer: GradReducer) -> None:
        """Finish ``reducer``'s reduction in flight, if any (its buffer is about to be reused)."""
        for pending in self._in_flight:
            if pending.reducer is reducer:
                pending.wait()  # stays queued, done: popping it later is a no-op

    def in_flight(self, reducer: GradReducer) -> bool:
        return any(p.reducer is reducer and not p.done for p in self._in_flight)

    def reap_landed(self) -> None:
        """Finish the reductions that already landed, freeing their gradients early.

        Without this a unit's gradients live until the next unit's reduction pushes it out
        of the in-flight window, i.e. through all of that unit's backward.
        """
        while self._reap_early and self._in_flight and self._in_flight[0].handle.is_completed():
            self._in_flight.popleft().wait()

    def drain(self) -> None:
        """Finish every reduction in flight, oldest first."""
        while self._in_flight:
            self._in_flight.popleft().wait()
