"""Where an FSDP unit is in one training iteration, and the moves it may make.

Every state says what is true of the unit's weights and gradients while in it, as FSDP2's
``TrainingState`` does. ``TrainingState.check_move`` is the one place that knows which moves
are legal; ``FSDPUnit._move_to`` is the one place that makes them.
"""

from __future__ import annotations

import enum

import torch


class TrainingState(enum.Enum):
    IDLE = "idle"
    """Outside forward and backward: weights sharded (a root, or a unit with
    ``reshard_after_forward=False``, keeps them unsharded from forward into backward); no
    gradient of this iteration has arrived."""

    FORWARD = "forward"
    """Its forward runs: weights unsharded (gathered at pre-forward), the next units'
    all-gathers may be in flight (forward prefetch)."""

    PRE_BACKWARD = "pre_backward"
    """Its backward runs (or its activations are being recomputed for it): weights
    unsharded, gradients arriving one parameter at a time into its reducers."""

    POST_BACKWARD = "post_backward"
    """Its backward is done for this iteration: weights resharded (ZeRO-3), its reductions
    launched into the root's queue. It stays here, whatever else runs, until the root's
    final callback ends the backward."""

    def check_move(self, to: TrainingState, unit: str) -> None:
        """Raise unless ``self -> to`` is a move the lifecycle makes."""
        if to not in _LEGAL[self]:
            raise RuntimeError(
                f"FSDP unit {unit}: illegal state change {self.name} -> {to.name}; this is a "
                "bug in the engine's hooks (or a module called in an order they do not "
                "support): please report it with the model's forward"
            )


_S = TrainingState
_LEGAL: dict[TrainingState, frozenset[TrainingState]] = {
    # forward; a backward whose pre-backward hook never fired reaches POST_BACKWARD
    # through the root's final callback; end_backward of a unit backward never reached.
    _S.IDLE: frozenset({_S.FORWARD, _S.PRE_BACKWARD, _S.POST_BACKWARD, _S.IDLE}),
    # post-forward; a module called twice in one forward re-enters FORWARD.
    _S.FORWARD: frozenset({_S.IDLE, _S.FORWARD}),
    # recompute inside its own backward re-enters PRE_BACKWARD; reset_iter_state after an
    # exception in backward goes back to IDLE.
    _S.PRE_BACKWARD: frozenset({_S.PRE_BACKWARD, _S.POST_BACKWARD, _S.IDLE}),
    # only the end of the whole backward (root's final callback) leaves it.
    _S.POST_BACKWARD: frozenset({_S.IDLE}),
}


def in_backward_pass() -> bool:
    """True while the autograd engine is executing, e.g. during activation recompute."""
    return bool(torch._C._current_graph_task_id() != -1)
