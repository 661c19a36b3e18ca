"""The engine's buffers through one steady-state forward and backward, charged into a
``LiveTensorTracker`` at the points the engine allocates and frees them (``StepEvents``).

Rules (those of ``mfsdp_hooks``' units, roots and reducers):

* Model states (compute and main weights, optimizer state) are live throughout; the
  gradients were freed by the last ``zero_grad()``.
* ZeRO-3 gathers a unit's weights (a codec's encode temporaries a moment before) at its
  pre-forward and pre-backward unless prefetched,
  frees them after its forward and after its backward; the root's stay from its forward to
  the end of backward. With ``post_forward_size`` k (``reshard_after_forward_group_size``)
  every unit, the root included, keeps ``1/k`` of them from its forward until its backward
  gathers them again (counted as gathered weights). With ``overlap_param_gather`` the next
  unit in forward order is gathered at a unit's pre-forward, and in backward the next unit
  in backward order once ``prefetch_fraction`` of the running unit's gradient elements
  arrived (the root at once).
* Each arriving gradient is kept (reduced in place: ``in_place``, its bytes in the compute
  dtype) or lands in the unit's padded reduce buffer (allocated at its first gradient).
  A unit's backward ends with its last gradient: its reduction is launched (its gradient
  shard allocated, kept until ``zero_grad``; the whole gradient under ZeRO-0, which the
  all-reduced buffer is copied into) and the oldest one in flight beyond ``window`` is
  waited, which frees the gradients it read and, under HFSDP, the compute-shard partial
  it reduced through (the engine may reap one earlier, once it
  landed: the plan keeps it to the window, the most it can hold). The root's ends the
  backward.

Each phase (a unit's forward, the loss, a unit's backward) is closed with ``tracker.mark``;
``phases`` lists them with the tracker's bytes per site at the phase's peak.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from mfsdp_buffers import LiveTensorTracker, PhaseMark

__all__ = ["EngineLedger", "UnitBuffers"]

GATHERED = "gathered_weights"
UNREDUCED = "unreduced_gradients"
GRADIENTS = "gradients"
CODEC = "codec_buffers"


@dataclass(frozen=True)
class UnitBuffers:
    """What the engine allocates for one unit on a rank."""

    gathered: int
    """Unsharded compute weights (ZeRO-3; 0 otherwise)."""
    grad_bytes: tuple[int, ...]
    """Per parameter that requires grad: the bytes kept when its gradient arrives in place."""
    grad_elements: tuple[int, ...]
    reduce_buffer: int
    """The padded reduce buffer, when gradients are not reduced in place."""
    grad_shard: int
    partial: int = 0
    """HFSDP: the compute-shard partial a reduction writes before crossing the replicas."""
    codec_scratch: int = 0
    """A codec's temporaries while it encodes this rank's slot for a gather (float8: the
    largest weight's local rows, their absolute values for the scale, their float8 bytes)."""


class EngineLedger:
    """Charges the engine's buffers into ``tracker`` as the step's events arrive."""

    def __init__(
        self,
        tracker: LiveTensorTracker,
        units: dict[str, UnitBuffers],
        *,
        forward_order: Sequence[str],
        backward_order: Sequence[str],
        overlap: bool,
        in_place: bool,
        prefetch_fraction: float,
        window: int = 1,
        post_forward_size: int | None = None,
    ) -> None:
        self.tracker, self.units = tracker, units
        self.forward_order, self.backward_order = list(forward_order), list(backward_order)
        self.overlap, self.in_place = overlap, in_place
        self.prefetch_fraction, self.window = prefetch_fraction, window
        self.post_forward_size = post_forward_size
        self._slices: dict[str, int] = {}
        self.phases: list[tuple[str, PhaseMark]] = []
        self._phase: str | None = None  # before the root's forward: nothing to report
        self._stack: list[str] = []
        self._in_backward = False
        self._gathered: set[str] = set()
        self._held: dict[str, int] = {}
        self._arrived: dict[str, int] = {}
        self._prefetched: set[str] = set()
        self._done: set[str] = set()
        self._in_flight: list[str] = []
        self.forward_seen: list[str] = []
        """Units in the order their forwards started (not recomputations)."""

    # ----------------------------------------------------------------- phases
    def _close(self, next_phase: str) -> None:
        mark = self.tracker.mark(self._phase or "")
        if self._phase is not None:
            self.phases.append((self._phase, mark))
        self._phase = next_phase

    def _name(self, unit: str) -> str:
        return unit or "<root>"

    # ----------------------------------------------------------------- weights
    def _gather(self, unit: str | None) -> None:
        if unit is None or unit in self._gathered or not self.units[unit].gathered:
            return
        self._gathered.add(unit)
        self.tracker.charge(self.units[unit].gathered, GATHERED)
        self._drop_slice(unit)  # copied into its place in the gathered buffer, then freed
        scratch = self.units[unit].codec_scratch
        if scratch:  # encoded into the gathered buffer's slot, then freed
            self.tracker.charge(scratch, CODEC)
            self.tracker.charge(-scratch, CODEC)

    def _keep_slice(self, unit: str) -> None:
        if self.post_forward_size and unit in self._gathered:
            self._slices[unit] = self.units[unit].gathered // self.post_forward_size
            self.tracker.charge(self._slices[unit], GATHERED)

    def _drop_slice(self, unit: str) -> None:
        self.tracker.charge(-self._slices.pop(unit, 0), GATHERED)

    def _reshard(self, unit: str) -> None:
        if unit in self._gathered:
            self._gathered.discard(unit)
            self.tracker.charge(-self.units[unit].gathered, GATHERED)

    def _next(self, order: list[str], unit: str) -> str | None:
        if not self.overlap or unit not in order:
            return None
        position = order.index(unit) + 1
        return order[position] if position < len(order) else None

    # ----------------------------------------------------------------- forward
    def forward_start(self, unit: str) -> None:
        if self._in_backward:  # recomputation: gathered for the backward, stays
            self._gather(unit)
            return
        self._close(f"forward of {self._name(unit)}")
        if unit not in self.forward_seen:
            self.forward_seen.append(unit)
        self._stack.append(unit)
        self._gather(unit)
        self._gather(self._next(self.forward_order, unit))

    def forward_end(self, unit: str) -> None:
        if self._in_backward:
            return
        self._stack.pop()
        parent = self._stack[-1] if self._stack else ""
        self._close(f"forward of {self._name(parent)}")
        if self.post_forward_size:  # every unit keeps its slice, the root's too
            self._keep_slice(unit)
            self._reshard(unit)
        elif unit:  # the root keeps its weights for the backward
            self._reshard(unit)

    def loss_start(self) -> None:
        self._close("loss")
        self._in_backward = True

    @property
    def backward_seen(self) -> list[str]:
        """Units in the order their backwards started."""
        return list(self._arrived)

    # ----------------------------------------------------------------- backward
    def backward_start(self, unit: str) -> None:
        if unit in self._arrived:
            return
        self._close(f"backward of {self._name(unit)}")
        for earlier in list(self._arrived):  # a unit with no gradient ends here
            if earlier and earlier not in self._done:
                self._end_backward(earlier)
        self._arrived[unit] = 0
        self._gather(unit)
        if unit == "":
            self._prefetch(unit)

    def _prefetch(self, unit: str) -> None:
        if unit not in self._prefetched:
            self._prefetched.add(unit)
            self._gather(self._next(self.backward_order, unit))

    def grad_arrived(self, unit: str, param: int) -> None:
        buffers = self.units[unit]
        if self.in_place:
            self._hold(unit, buffers.grad_bytes[param])
        elif unit not in self._held:
            self._hold(unit, buffers.reduce_buffer)
        self._arrived[unit] = self._arrived.get(unit, 0) + buffers.grad_elements[param]
        total = sum(buffers.grad_elements)
        if self._arrived[unit] >= self.prefetch_fraction * total:
            self._prefetch(unit)
        if unit and self._arrived[unit] >= total:
            self._end_backward(unit)

    def _hold(self, unit: str, nbytes: int) -> None:
        self._held[unit] = self._held.get(unit, 0) + nbytes
        self.tracker.charge(nbytes, UNREDUCED)

    def _end_backward(self, unit: str) -> None:
        """Its backward is over (once): reshard, launch its reduction."""
        if unit in self._done:  # a gradient arriving after the next unit's backward began
            return
        self._done.add(unit)
        self._reshard(unit)
        if not self.units[unit].grad_elements:
            return
        self.tracker.charge(self.units[unit].grad_shard, GRADIENTS)
        self._hold(unit, self.units[unit].partial)
        self._in_flight.append(unit)
        while len(self._in_flight) > self.window:
            self._wait(self._in_flight.pop(0))

    def _wait(self, unit: str) -> None:
        self.tracker.charge(-self._held.pop(unit, 0), UNREDUCED)

    def backward_end(self) -> None:
        for unit in list(self._arrived):
            if unit not in self._done:
                self._end_backward(unit)
        for unit in self._in_flight:
            self._wait(unit)
        self._in_flight = []
        self._close("end of backward")
        for unit in list(self._gathered):
            self._reshard(unit)
        for unit in list(self._slices):  # a unit no gradient reached
            self._drop_slice(unit)
