"""How a unit gathers the units that run after it: one at a time, or coalesced.

Without coalescing each unit of the prefetch window (``ExecutionOrder``) not yet gathered is
issued on its own: a sliding window. With coalescing (the reference's merging of small units
up to ``suggested_communication_unit_size``) nothing is issued while the next unit is on its
way; once it is not, the whole window goes out together (``coalesced_gathers``). Either way
at most the window is gathered ahead; coalescing trades its steady refill for one collective.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from mfsdp_collectives import coalesced_gathers
from mfsdp_hooks.runtime.training_state import TrainingState

__all__ = ["PrefetchTarget", "gather_ahead"]


class PrefetchTarget(Protocol):
    """A unit, as seen by the unit that prefetches it."""

    @property
    def state(self) -> TrainingState: ...

    @property
    def is_unsharded(self) -> bool: ...

    def unshard_async(self) -> None: ...


def gather_ahead(targets: Sequence[PrefetchTarget], *, coalesce: bool) -> None:
    """Issue the all-gathers of ``targets`` (in run order) that are not on their way yet."""
    if not coalesce:
        for target in targets:
            target.unshard_async()
        return
    if not targets or targets[0].is_unsharded:  # the window has not drained yet
        return
    with coalesced_gathers():
        for target in targets:
            target.unshard_async()
