"""An opt-in host timeline of one model's units: where each training step's time went
(``docs/timeline.md`` says what a step, a span and each share are).

Spans of the compute thread nest, and each instant of a step belongs to the innermost span
open then (its ``self_ns``) or to none (the step's ``other_ns``), so the shares partition
the step exactly; in-flight intervals (issue until found done) overlap them. Off, each
instrumentation point reads ``ACTIVE`` (and the reduction queue its observer) and goes on.
A trace is process-wide and one at a time: autograd may run hooks on another thread, but the
compute thread's time is one line.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch.autograd.profiler import record_function

from mfsdp_collectives import CommStreams
from mfsdp_hooks.grads.grad_reducer import GradReducer
from mfsdp_hooks.grads.reduction_queue import observe_reductions
from mfsdp_hooks.runtime.observe import FSDPUnit as ShownUnit
from mfsdp_hooks.runtime.observe import unit_label
from mfsdp_hooks.runtime.timeline_device import DeviceClock, DeviceMark
from mfsdp_hooks.runtime.timeline_events import (
    EventKind,
    TimelineEvent,
    TimelineStep,
    with_device_events,
)

__all__ = ["ACTIVE", "TimelineRecorder", "record_timeline"]

ACTIVE: TimelineRecorder | None = None
"""The trace in progress; every instrumentation point reads it (None: tracing is off)."""

_now = time.perf_counter_ns
_FLIGHT = {EventKind.ALL_GATHER_WAIT: EventKind.ALL_GATHER, EventKind.REDUCE_WAIT: EventKind.REDUCE}
# An issue span's side stream (a ``CommStreams`` field) and the device interval it issued.
_ISSUED = {
    EventKind.ALL_GATHER_ISSUE: ("all_gather", EventKind.ALL_GATHER_DEVICE),
    EventKind.REDUCE_ISSUE: ("reduce_scatter", EventKind.REDUCE_DEVICE),
}
_COMPUTE = (EventKind.FORWARD, EventKind.BACKWARD, EventKind.RECOMPUTE, EventKind.OPTIMIZER)
OUTSIDE_UNITS = "outside the units"
"""The segment of a step in no unit's forward or backward (the loss, autograd's own work)."""


class _Span:
    """A span open on the compute thread, and its profiler range; ``end()`` closes it and
    any span opened inside it that is still open."""

    __slots__ = (
        "_range",
        "_recorder",
        "device",
        "issued_ns",
        "kind",
        "owner",
        "self_ns",
        "start_ns",
        "unit",
    )

    def __init__(
        self, recorder: TimelineRecorder, kind: EventKind, owner: int, unit: str | None, now: int
    ) -> None:
        self._recorder = recorder
        self.kind, self.owner, self.unit, self.start_ns = kind, owner, unit, now
        self.self_ns = 0
        self.issued_ns: int | None = None  # a wait: when what it waits for was issued
        self.device: DeviceMark | None = None
        self._range: record_function | None = None
        if recorder.profiler_ranges:
            self._range = record_function(f"mfsdp:{kind.value}" + (f" {unit}" if unit else ""))
            self._range.__enter__()  # type: ignore[no-untyped-call]

    def end(self, keep: bool = True) -> None:
        """Close the span; ``keep=False`` forgets it (its time goes to the span around it)."""
        self._recorder.close(self, keep)

    def exit_range(self) -> None:
        if self._range is not None:
            self._range.__exit__(None, None, None)


class _OpenStep:
    """The step being recorded."""

    def __init__(self, index: int, start_ns: int) -> None:
        self.index, self.start_ns = index, start_ns
        self.events: list[TimelineEvent] = []
        self.other_ns = 0

    def freeze(self, end_ns: int) -> TimelineStep:
        return TimelineStep(self.index, self.start_ns, end_ns, tuple(self.events), self.other_ns)


class TimelineRecorder:
    """Records one model's units while ``record_timeline`` runs; ``steps`` are the complete
    steps so far. The methods below are what the instrumentation points call."""

    def __init__(
        self,
        units: Sequence[ShownUnit],
        optimizer: torch.optim.Optimizer | None = None,
        on_segment: Callable[[str], None] | None = None,
        profiler_ranges: bool = True,
    ) -> None:
        self._units = list(units)
        self._on_segment = on_segment
        self.profiler_ranges = profiler_ranges
        self._segment: str | None = None
        self._traced = {id(unit) for unit in units}
        self._reducer_unit = {
            id(g.reducer): unit for unit in units for g in unit.groups if g.reducer is not None
        }
        self._optimizer = optimizer
        self._labels: dict[int, str] = {}
        self._stack: list[_Span] = []
        self._step: _OpenStep | None = None
        self._last_ns = 0
        # Issue time of what is in flight: each unit's gathers, each reducer's reduction.
        self._gathers: dict[int, int] = {}
        self._reductions: dict[int, int] = {}
        self._optimizer_span: _Span | None = None
        self._in_attached_step = False
        self._device = DeviceClock()
        self.origin_ns = _now()
        self.steps: list[TimelineStep] = []

    def unit_labels(self) -> list[str]:
        """The traced units' names (``unit_label``), in module order."""
        return [unit_label(unit) for unit in self._units]

    # ----------------------------------------------------------------- units (runtime/unit)
    def forward_begins(self, unit: ShownUnit, *, root: bool, recompute: bool) -> None:
        if id(unit) not in self._traced:
            return
        now = _now()
        if root and not recompute:
            self._root_forward(now)
        self._open(EventKind.RECOMPUTE if recompute else EventKind.FORWARD, unit, now)

    def forward_ends(self, unit: ShownUnit) -> None:
        self._close_unit(unit, (EventKind.FORWARD, EventKind.RECOMPUTE))

    def backward_begins(self, unit: ShownUnit) -> None:
        self._open(EventKind.BACKWARD, unit, _now())

    def backward_ends(self, unit: ShownUnit) -> None:
        self._close_unit(unit, (EventKind.BACKWARD,))

    def gather_issue(self, unit: ShownUnit, streams: CommStreams | None) -> _Span | None:
        """Around an unshard; end it with ``keep=False`` when it issued no gather."""
        return self._open(EventKind.ALL_GATHER_ISSUE, unit, _now(), streams=streams)

    def gather_wait(self, unit: ShownUnit) -> _Span | None:
        issued = self._gathers.pop(id(unit), None)
        return self._open(EventKind.ALL_GATHER_WAIT, unit, _now(), issued_ns=issued)

    # ----------------------------------------------------------------- the reduction queue
    def reduction_span(
        self, reducer: GradReducer, streams: CommStreams | None, *, waiting: bool
    ) -> _Span | None:
        """``grads.reduction_queue.ReductionObserver``: a launch, or a wait that blocks."""
        unit = self._reducer_unit.get(id(reducer))
        if unit is None:
            return None
        kind = EventKind.REDUCE_WAIT if waiting else EventKind.REDUCE_ISSUE
        issued = self._reductions.pop(id(reducer), None) if waiting else None
        return self._open(kind, unit, _now(), owner=id(reducer), issued_ns=issued, streams=streams)

    # ----------------------------------------------------------------- the optimizer
    def optimizer_pre_hook(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        """torch's ``register_step_pre_hook`` (a step inside ``attached_step`` is already one
        span)."""
        if not self._in_attached_step:
            self._optimizer_begins()

    def optimizer_post_hook(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        if not self._in_attached_step:
            self._optimizer_ends()

    @contextlib.contextmanager
    def attached_step(self, optimizer: torch.optim.Optimizer) -> Iterator[None]:
        """An attached optimizer's whole ``step()``: it finishes the reductions before torch's
        step and installs the updated weights after it, and all of it is the step's cost."""
        if optimizer is not self._optimizer or self._in_attached_step:
            yield
            return
        self._in_attached_step = True
        self._optimizer_begins()
        try:
            yield
        finally:
            self._in_attached_step = False
            self._optimizer_ends()

    def _optimizer_begins(self) -> None:
        if self._step is not None:
            self._optimizer_span = self._push(EventKind.OPTIMIZER, id(self), None, _now())

    def _optimizer_ends(self) -> None:
        span, self._optimizer_span = self._optimizer_span, None
        if span is None or self._step is None:
            return
        now = _now()
        self.close(span, True, now)
        self._close_step(now)

    # ----------------------------------------------------------------- steps and spans
    def _root_forward(self, now: int) -> None:
        """A new step, unless the open one waits for its optimizer (gradient accumulation)."""
        if self._step is not None:
            self._close_spans(now)  # left open by an iteration an exception cut short
            if self._optimizer is not None:
                return
            self._close_step(now)
        self._step = _OpenStep(len(self.steps), now)
        self._last_ns = now

    def _close_step(self, now: int) -> None:
        assert self._step is not None
        self._close_spans(now)
        self._advance(now)
        self.steps.append(self._step.freeze(now))
        self._step = None

    def _label(self, unit: ShownUnit) -> str:
        label = self._labels.get(id(unit))
        if label is None:
            label = self._labels[id(unit)] = unit_label(unit)
        return label

    def _open(
        self,
        kind: EventKind,
        unit: ShownUnit,
        now: int,
        *,
        owner: int | None = None,
        issued_ns: int | None = None,
        streams: CommStreams | None = None,
    ) -> _Span | None:
        """A span of a traced unit in a step (an issue's marks its streams' device time)."""
        if self._step is None or id(unit) not in self._traced:
            return None
        span = self._push(kind, id(unit) if owner is None else owner, self._label(unit), now)
        span.issued_ns = issued_ns
        if kind in _ISSUED:
            span.device = self._device.begin(streams)
        return span

    def _push(self, kind: EventKind, owner: int, unit: str | None, now: int) -> _Span:
        self._advance(now)
        span = _Span(self, kind, owner, unit, now)
        self._stack.append(span)
        self._segment_may_change()
        return span

    def _segment_may_change(self) -> None:
        """Tell ``on_segment`` when the compute segment changed: the innermost forward,
        backward or recompute of a unit open now, the optimizer step, or none of them."""
        if self._on_segment is None:
            return
        span = next((s for s in reversed(self._stack) if s.kind in _COMPUTE), None)
        if span is None:
            segment = OUTSIDE_UNITS if self._step is not None else None
        elif span.kind is EventKind.OPTIMIZER:
            segment = "optimizer step"
        else:
            segment = f"{span.kind.value} of {span.unit}"
        if segment is not None and segment != self._segment:
            self._on_segment(segment)
        self._segment = segment

    def _advance(self, now: int) -> None:
        """The time since the last change belongs to the innermost open span, or to none."""
        elapsed, self._last_ns = now - self._last_ns, now
        if self._stack:
            self._stack[-1].self_ns += elapsed
        elif self._step is not None:
            self._step.other_ns += elapsed

    def _close_unit(self, unit: ShownUnit, kinds: tuple[EventKind, ...]) -> None:
        for span in reversed(self._stack):
            if span.owner == id(unit) and span.kind in kinds:
                self.close(span, True)
                return

    def close(self, span: _Span, keep: bool, now: int | None = None) -> None:
        """Close ``span`` and, first, any span still open inside it (an outer unit's
        backward may end before an inner one's: the root's final callback)."""
        if not any(open_span is span for open_span in self._stack):
            return  # closed with a span around it
        now = _now() if now is None else now
        self._advance(now)
        while self._stack[-1] is not span:
            self._finish(self._stack.pop(), now, keep=True)
        self._finish(self._stack.pop(), now, keep=keep)
        self._segment_may_change()

    def _close_spans(self, now: int) -> None:
        if self._stack:
            self.close(self._stack[0], True, now)

    def _finish(self, span: _Span, now: int, *, keep: bool) -> None:
        span.exit_range()
        step = self._step
        assert step is not None
        if not keep:  # its time was the enclosing span's all along
            if self._stack:
                self._stack[-1].self_ns += span.self_ns
            else:
                step.other_ns += span.self_ns
            return
        step.events.append(TimelineEvent(span.kind, span.unit, span.start_ns, now, span.self_ns))
        flight = _FLIGHT.get(span.kind)
        if flight is not None and span.issued_ns is not None:
            step.events.append(TimelineEvent(flight, span.unit, span.issued_ns, now))
        if span.kind is EventKind.ALL_GATHER_ISSUE:
            self._gathers.setdefault(span.owner, span.start_ns)
        elif span.kind is EventKind.REDUCE_ISSUE:
            self._reductions[span.owner] = span.start_ns
        issued = _ISSUED.get(span.kind)
        if span.device is not None and issued is not None:
            role, device = issued
            self._device.end(span.device, device.value, span.unit or "", step.index, role)

    def finish(self) -> None:
        """The trace ends: close the open step and place the device intervals."""
        if self._step is not None:
            self._close_step(_now())
        self.steps = with_device_events(self.steps, self._device.resolve())


@contextlib.contextmanager
def record_timeline(
    units: Sequence[ShownUnit],
    optimizer: torch.optim.Optimizer | None = None,
    *,
    on_segment: Callable[[str], None] | None = None,
    profiler_ranges: bool = True,
) -> Iterator[TimelineRecorder]:
    """Record ``units`` (one model's, its root among them) until the block ends.

    ``optimizer``: its steps end the steps (through torch's step hooks, removed at the end);
    without one a step ends at the next forward of the root. ``on_segment(name)`` is called
    on the compute thread as a step enters each segment (``"forward of blocks.0 (Block)"``,
    ``"backward of ..."``, ``"optimizer step"``, ``OUTSIDE_UNITS``), before its work runs:
    a memory planner closes a phase there. ``profiler_ranges=False``: no ``torch.profiler``
    range per span (each is an op through the dispatcher; a planning run's fake ops cost
    ~100 us each).
    """
    global ACTIVE
    if not units:
        raise ValueError("units: nothing to trace; pass the FSDP units of a sharded model")
    if ACTIVE is not None:
        raise RuntimeError(
            "a timeline is already recording: traces run one at a time (end the other first)"
        )
    recorder = TimelineRecorder(units, optimizer, on_segment, profiler_ranges)
    hooks = []
    if optimizer is not None:
        hooks = [
            optimizer.register_step_pre_hook(recorder.optimizer_pre_hook),
            optimizer.register_step_post_hook(recorder.optimizer_post_hook),
        ]
    ACTIVE = recorder
    observe_reductions(recorder)
    try:
        yield recorder
    finally:
        ACTIVE = None
        observe_reductions(None)
        for hook in hooks:
            hook.remove()
        recorder.finish()
