"""When a parameter group's compute weights must be re-installed from its main weights.

The optimizer steps the optimizer-facing weights (main weights, or the model shard itself);
forward and backward read the compute weights. Two flags say when the second must be
rebuilt from the first:

* ``dirty``: rebuild once, at the next unshard (after a load or an attached optimizer's step).
* ``step_window_open``: from a backward that synced the gradients until the next backward
  begins. A bare optimizer (one the engine never sees: nothing is registered process-wide,
  and a step through DTensors bumps no version counter) may step at any moment in it, so
  every forward (and every unshard a user asks for) in the window marks the weights dirty
  again. An attached optimizer closes the window itself, right after its step; once one
  steps a group (``attach_stepper``), its synced backwards open no window at all, so the
  micro-batches of a cycle that syncs each of them do not re-install (under HFSDP each
  install is an all-gather across ``dp_outer``). A bare optimizer stepping a group that an
  attached one also steps must be followed by ``install_optimized_model_weights()``.

All transitions are the methods below; the flags are read-only outside.
"""

from __future__ import annotations

import enum

__all__ = ["WeightFreshness", "WeightPath", "weight_path"]


class WeightFreshness:
    """The two flags above for one parameter group; ``steppable`` is its ``requires_grad``."""

    def __init__(self, *, steppable: bool) -> None:
        self._steppable = steppable
        self._attached = False
        self._dirty = False
        self._window_open = False

    @property
    def dirty(self) -> bool:
        """The compute weights must be rebuilt from the optimizer-facing ones."""
        return self._dirty

    @property
    def step_window_open(self) -> bool:
        """An optimizer the engine does not see may step before the next backward."""
        return self._window_open

    def attach_stepper(self) -> None:
        """An attached optimizer steps this group and marks the weights dirty itself."""
        self._attached = True

    def mark_dirty(self) -> None:
        """A load, or ``mark_weights_dirty``: rebuild the compute weights once."""
        self._dirty = True

    def installed(self) -> None:
        """The compute weights were rebuilt from the optimizer-facing ones (an install, or
        the gather that encodes the main shard): current until the next step or load."""
        self._dirty = False

    def open_step_window(self) -> None:
        """A synced backward ended (or ``finish_grad_sync``): an optimizer the engine does not
        see may step next."""
        self._window_open = self._steppable and not self._attached

    def close_step_window(self, *, stepped: bool) -> None:
        """A backward began (no step comes between a forward and its backward), or an
        attached optimizer or ``install_optimized_model_weights()`` ``stepped``: then
        re-install once and trust the weights after."""
        self._window_open = False
        if stepped:
            self._dirty = True

    def recheck_step_window(self) -> None:
        """Before a forward, or an unshard asked for outside one: inside a step window the
        weights may have been stepped since they were installed, so install them again."""
        if self._window_open:
            self._dirty = True


class WeightPath(enum.Enum):
    """What making a group's compute weights current takes, in the order it is done.

    ``REFRESH`` rebuilds the persistent compute shard from the optimizer-facing weights
    (under HFSDP an all-gather across ``dp_outer``; nothing to do otherwise), ``GATHER``
    all-gathers the compute shards into the unsharded buffer, ``ENCODE_WHOLE`` encodes the
    whole main weights into the whole compute weights on this rank, ``ENCODE_AND_GATHER``
    encodes this rank's main shard into its slot of the whole compute weights and
    all-gathers the others'.
    """

    CURRENT = "current"
    GATHER = "gather"
    REFRESH = "refresh"
    REFRESH_AND_GATHER = "refresh_and_gather"
    ENCODE_WHOLE = "encode_whole"
    ENCODE_AND_GATHER = "encode_and_gather"


def weight_path(
    *, sharded: bool, gathered: bool, stale: bool, unsharding: bool, whole_main: bool
) -> WeightPath:
    """The ``WeightPath`` of a group.

    ``sharded``: its compute weights are sharded between uses (ZeRO-3); ``gathered``: they
    are unsharded now; ``stale``: they must be rebuilt from the optimizer-facing weights
    (``WeightFreshness.dirty``, or an explicit install); ``unsharding``: the caller needs the
    unsharded weights (an unshard), not only current ones (an install); ``whole_main``:
    each rank holds the whole optimizer-facing weights (``no_shard``, or one rank).
    """
    if not stale:
        return WeightPath.GATHER if sharded and unsharding and not gathered else WeightPath.CURRENT
    if sharded:
        return WeightPath.REFRESH_AND_GATHER if gathered or unsharding else WeightPath.REFRESH
    return WeightPath.ENCODE_WHOLE if whole_main else WeightPath.ENCODE_AND_GATHER
