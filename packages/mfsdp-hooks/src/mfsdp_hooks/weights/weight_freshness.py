"""When a parameter group's compute weights must be re-installed from its main weights.

The optimizer steps the optimizer-facing weights (main weights, or the model shard itself);
forward and backward read the compute weights. Two flags say when the second must be
rebuilt from the first:

* ``dirty``: once, at the next unshard. Set after a load, after an attached optimizer's step
  and by ``mark_dirty``; cleared by the install (or gather) that rebuilds the weights.
* ``step_window_open``: from a backward that synced the gradients until the next backward
  begins. A bare optimizer (one the engine never sees: nothing is registered process-wide,
  and a step through DTensors bumps no version counter) may step at any moment in it, so
  every forward (and every unshard a user asks for) in the window marks the weights dirty
  again. An attached optimizer closes the window itself, right after its step; once one
  steps a group (``attach_stepper``), its synced backwards open no window at all, so the
  micro-batches of a cycle that syncs each of them do not re-install (under HFSDP each
  install is an all-gather across ``dp_outer``). A bare optimizer stepping a group that an
  attached one also steps must be followed by ``install_optimized_model_weights()``.

Transitions, all here: ``open_step_window`` (synced backward ends, or ``finish_grad_sync``)
-> ``recheck_step_window`` (forward or user unshard: dirty if open) -> ``close_step_window``
(a backward begins, ``stepped=False``; an attached step or explicit install, ``stepped=True``).
"""

from __future__ import annotations

__all__ = ["WeightFreshness"]


class WeightFreshness:
    """The two flags above for one parameter group; ``steppable`` is its ``requires_grad``."""

    def __init__(self, *, steppable: bool) -> None:
        self._steppable = steppable
        self._attached = False
        self.dirty = False
        self.step_window_open = False

    def attach_stepper(self) -> None:
        """An attached optimizer steps this group and marks the weights dirty itself."""
        self._attached = True

    def mark_dirty(self) -> None:
        self.dirty = True

    def open_step_window(self) -> None:
        """Its gradients are synced: an optimizer the engine does not see may step next."""
        self.step_window_open = self._steppable and not self._attached

    def close_step_window(self, *, stepped: bool) -> None:
        """A backward began (no step comes between a forward and its backward), or an
        attached optimizer ``stepped``: then re-install once and trust the weights after."""
        self.step_window_open = False
        if stepped:
            self.dirty = True

    def recheck_step_window(self) -> None:
        """Before a forward, or an unshard asked for outside one: inside a step window the
        weights may have been stepped since they were installed, so install them again."""
        if self.step_window_open:
            self.dirty = True
