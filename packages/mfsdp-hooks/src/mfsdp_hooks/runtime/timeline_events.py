"""What a timeline records (``timeline``): event kinds, events and steps, plain data, so
that readers depend on the data alone. Every span of the compute thread has a ``category``
where its ``self_ns`` counts; with the step's ``other_ns`` they add up to its host time.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from mfsdp_hooks.runtime.timeline_device import DeviceInterval

__all__ = ["HOST_CATEGORIES", "EventKind", "TimelineEvent", "TimelineStep", "with_device_events"]

HOST_CATEGORIES = ("compute", "all_gather_exposed", "reduce_exposed", "optimizer", "other")
"""The shares of a step's host time (``TimelineStep.host_time``); they add up to the step."""


class EventKind(enum.Enum):
    """What an event is. Spans of the compute thread have a ``category``; in-flight and device
    intervals (``ALL_GATHER``, ``REDUCE`` and their ``_DEVICE`` forms) have none."""

    FORWARD = "forward"
    BACKWARD = "backward"
    RECOMPUTE = "recompute"
    """A forward run again inside backward (activation checkpointing): backward compute."""
    ALL_GATHER_ISSUE = "all_gather_issue"
    ALL_GATHER_WAIT = "all_gather_wait"
    REDUCE_ISSUE = "reduce_issue"
    REDUCE_WAIT = "reduce_wait"
    OPTIMIZER = "optimizer"
    ALL_GATHER = "all_gather"
    """A unit's all-gathers in flight: from their issue until the compute thread found them
    ready (an upper bound of when they landed)."""
    REDUCE = "reduce"
    """A reduction in flight: from its issue until the wait that completed it returned."""
    ALL_GATHER_DEVICE = "all_gather_device"
    REDUCE_DEVICE = "reduce_device"

    @property
    def category(self) -> str | None:
        """The share of host time a span's ``self_ns`` belongs to (None: not a span)."""
        return _CATEGORY.get(self)

    @property
    def lane(self) -> str:
        """Where it is drawn: compute thread, optimizer, or the collective's own lane."""
        return _LANE.get(self, "compute")


_CATEGORY = {
    EventKind.FORWARD: "compute",
    EventKind.BACKWARD: "compute",
    EventKind.RECOMPUTE: "compute",
    EventKind.ALL_GATHER_ISSUE: "all_gather_exposed",
    EventKind.ALL_GATHER_WAIT: "all_gather_exposed",
    EventKind.REDUCE_ISSUE: "reduce_exposed",
    EventKind.REDUCE_WAIT: "reduce_exposed",
    EventKind.OPTIMIZER: "optimizer",
}
_LANE = {
    EventKind.OPTIMIZER: "optimizer",
    EventKind.ALL_GATHER: "all-gather",
    EventKind.REDUCE: "reduce-scatter",
    EventKind.ALL_GATHER_DEVICE: "all-gather (device)",
    EventKind.REDUCE_DEVICE: "reduce-scatter (device)",
}


@dataclass(frozen=True)
class TimelineEvent:
    """One span or interval, in host ``time.perf_counter_ns`` nanoseconds."""

    kind: EventKind
    unit: str | None
    """The unit's ``unit_label`` (``blocks.0 (Block)``); None for the optimizer."""
    start_ns: int
    end_ns: int
    self_ns: int = 0
    """A span's time with no span nested inside it open (0 for in-flight intervals)."""

    @property
    def duration_ns(self) -> int:
        return self.end_ns - self.start_ns


@dataclass(frozen=True)
class TimelineStep:
    """One training step: from the root's forward to the end of the optimizer's step."""

    index: int
    start_ns: int
    end_ns: int
    events: tuple[TimelineEvent, ...]
    other_ns: int
    """Host time in no span: data loading, the loss, autograd outside any unit, hooks."""

    @property
    def duration_ns(self) -> int:
        return self.end_ns - self.start_ns

    def host_time(self) -> Mapping[str, int]:
        """Nanoseconds per ``HOST_CATEGORIES`` entry; their sum is ``duration_ns`` exactly."""
        shares = dict.fromkeys(HOST_CATEGORIES, 0)
        for event in self.events:
            category = event.kind.category
            if category is not None:
                shares[category] += event.self_ns
        shares["other"] += self.other_ns
        return shares

    def of_kind(self, kind: EventKind, unit: str | None = None) -> list[TimelineEvent]:
        """This step's events of ``kind`` (of ``unit`` only, when given), in closing order."""
        return [e for e in self.events if e.kind is kind and (unit is None or e.unit == unit)]


def with_device_events(
    steps: Sequence[TimelineStep], intervals: Iterable[DeviceInterval]
) -> list[TimelineStep]:
    """``steps`` with each device interval added to the step that issued it."""
    added: dict[int, list[TimelineEvent]] = {}
    for found in intervals:
        event = TimelineEvent(EventKind(found.kind), found.unit, found.start_ns, found.end_ns)
        added.setdefault(found.step, []).append(event)
    return [
        dataclasses.replace(step, events=step.events + tuple(added.get(step.index, ())))
        for step in steps
    ]
