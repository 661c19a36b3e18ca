"""When a unit gathers the units that run backward after it.

In backward, a unit prefetches (all-gathers) the next units' weights while its own backward
runs. Issuing that at the unit's first gradient would put the next unit's weights in memory
next to this unit's widest activations; waiting for ``grad_fraction`` of this unit's gradient
elements lets those activations die first, so the two do not add up in the backward peak.
"""

from __future__ import annotations

from collections.abc import Sequence

from mfsdp_hooks.runtime.gather_ahead import PrefetchTarget, gather_ahead
from mfsdp_hooks.runtime.training_state import TrainingState


class BackwardPrefetch:
    """One unit's pending backward prefetch, paced by how much of its gradient arrived."""

    def __init__(self, grad_numel_expected: int) -> None:
        self._expected = grad_numel_expected
        self._received = 0
        self._threshold = 0.0
        self._pending: list[PrefetchTarget] = []
        self._coalesce = False

    def begin(
        self,
        targets: Sequence[PrefetchTarget],
        grad_fraction: float,
        *,
        coalesce: bool,
        force: bool = False,
    ) -> None:
        """The unit's backward starts: prefetch ``targets`` (``coalesce``: see
        ``gather_ahead``) once ``grad_fraction`` of its gradient elements arrived, or now
        if ``force``."""
        self._received = 0
        self._threshold = grad_fraction * self._expected
        self._pending = list(targets)
        self._coalesce = coalesce
        self.issue(force=force)

    def on_grad(self, numel: int) -> None:
        self._received += numel
        if self._pending:
            self.issue()

    def issue(self, force: bool = False) -> None:
        """Gather the pending targets now if enough gradient arrived, or ``force``."""
        if not self._pending or (not force and self._received < self._threshold):
            return
        targets, self._pending = self._pending, []
        idle = [target for target in targets if target.state is TrainingState.IDLE]
        gather_ahead(idle, coalesce=self._coalesce)

    def drop(self) -> None:
        self._pending = []
