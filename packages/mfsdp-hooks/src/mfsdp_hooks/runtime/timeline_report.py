"""The overlap report of a recorded timeline (``megatron_fsdp``'s ``Timeline.overlap_report()``,
``docs/timeline.md``): per unit and per step, where the host's time went. Host time shares
partition the steps' wall time; in-flight times run beside compute, outside the partition.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

from mfsdp_hooks.runtime.timeline_events import HOST_CATEGORIES, EventKind, TimelineStep

__all__ = ["OverlapReport", "UnitTimes", "build_overlap_report"]

# Which per-unit field each event adds to, and whether with its self time or its duration.
_UNIT_FIELD: dict[EventKind, tuple[str, bool]] = {
    EventKind.FORWARD: ("forward_ns", True),
    EventKind.BACKWARD: ("backward_ns", True),
    EventKind.RECOMPUTE: ("backward_ns", True),
    EventKind.ALL_GATHER: ("all_gather_ns", False),
    EventKind.ALL_GATHER_ISSUE: ("all_gather_exposed_ns", True),
    EventKind.ALL_GATHER_WAIT: ("all_gather_exposed_ns", True),
    EventKind.REDUCE: ("reduce_ns", False),
    EventKind.REDUCE_ISSUE: ("reduce_exposed_ns", True),
    EventKind.REDUCE_WAIT: ("reduce_exposed_ns", True),
}


@dataclass(frozen=True)
class UnitTimes:
    """One unit's nanoseconds, summed over the reported steps: the report's columns, in
    their order (``docs/timeline.md`` says what each counts)."""

    unit: str
    forward_ns: int = 0
    backward_ns: int = 0
    all_gather_ns: int = 0
    all_gather_exposed_ns: int = 0
    reduce_ns: int = 0
    reduce_exposed_ns: int = 0

    @property
    def exposed_ns(self) -> int:
        return self.all_gather_exposed_ns + self.reduce_exposed_ns


@dataclass(frozen=True)
class OverlapReport:
    """Where the reported steps' host time went; ``str()`` is a table (per step means)."""

    rank: int
    steps: int
    units: tuple[UnitTimes, ...]
    step_ns: int
    """The steps' wall time on the host, summed: the five shares below add up to it."""
    compute_ns: int
    all_gather_exposed_ns: int
    reduce_exposed_ns: int
    optimizer_ns: int
    other_ns: int

    @property
    def exposed_communication_ns(self) -> int:
        return self.all_gather_exposed_ns + self.reduce_exposed_ns

    @property
    def communication_ns(self) -> int:
        """Every unit's collectives in flight, summed (they may overlap one another)."""
        return sum(u.all_gather_ns + u.reduce_ns for u in self.units)

    @property
    def overlap_efficiency(self) -> float | None:
        """The share of communication hidden behind other work,
        ``1 - exposed_communication_ns / communication_ns``; None when nothing was communicated."""
        if self.communication_ns == 0:
            return None
        return 1.0 - self.exposed_communication_ns / self.communication_ns

    @property
    def most_exposed_unit(self) -> str | None:
        """The unit whose collectives kept the compute thread waiting longest (None when
        none did)."""
        worst = max(self.units, key=lambda u: u.exposed_ns, default=None)
        return None if worst is None or worst.exposed_ns == 0 else worst.unit

    def __str__(self) -> str:
        return "\n".join(self._table() + self._summary())

    def _ms(self, ns: int) -> str:
        return f"{ns / 1e6 / self.steps:.2f}"

    def _table(self) -> list[str]:
        width = max([len("unit"), *(len(u.unit) for u in self.units)])
        head = ["forward", "backward", "all-gather", "AG exposed", "reduce", "RS exposed"]
        lines = [
            f"Timeline, rank {self.rank}: {self.steps} step(s), ms per step",
            f"{'unit':<{width}}  " + "  ".join(f"{h:>10}" for h in head),
        ]
        for u in self.units:
            cells = [getattr(u, field.name) for field in dataclasses.fields(u)[1:]]
            lines.append(f"{u.unit:<{width}}  " + "  ".join(f"{self._ms(c):>10}" for c in cells))
        return lines

    def _summary(self) -> list[str]:
        def share(name: str, ns: int) -> str:
            return f"  {name:<20} {self._ms(ns):>9} ms  {100 * ns / max(self.step_ns, 1):5.1f}%"

        efficiency = self.overlap_efficiency
        hidden = "n/a (no communication)" if efficiency is None else f"{100 * efficiency:.1f}%"
        worst = self.most_exposed_unit
        return [
            f"step time            {self._ms(self.step_ns):>9} ms",
            share("compute", self.compute_ns),
            share("exposed all-gather", self.all_gather_exposed_ns),
            share("exposed reduce", self.reduce_exposed_ns),
            share("optimizer", self.optimizer_ns),
            share("other", self.other_ns),
            f"overlap efficiency: {hidden} of communication time hidden",
            f"most exposed unit: {worst or 'none'}",
        ]


def build_overlap_report(
    steps: Sequence[TimelineStep], units: Sequence[str], rank: int
) -> OverlapReport:
    """The report over ``steps``; ``units`` gives the table's order (module order)."""
    if not steps:
        raise ValueError(
            "steps: the timeline holds no complete step to report on; run at least one "
            "forward of the traced model's root inside trace() (and skip fewer warm-up steps)"
        )
    fields = {name for name, _ in _UNIT_FIELD.values()}
    by_unit = {unit: dict.fromkeys(fields, 0) for unit in units}
    shares = dict.fromkeys(HOST_CATEGORIES, 0)
    for step in steps:
        for category, ns in step.host_time().items():
            shares[category] += ns
        for event in step.events:
            field = _UNIT_FIELD.get(event.kind)
            if field is None or event.unit is None:
                continue
            name, own = field
            times = by_unit.setdefault(event.unit, dict.fromkeys(fields, 0))
            times[name] += event.self_ns if own else event.duration_ns
    return OverlapReport(
        rank=rank,
        steps=len(steps),
        units=tuple(UnitTimes(unit, **times) for unit, times in by_unit.items()),
        step_ns=sum(step.duration_ns for step in steps),
        compute_ns=shares["compute"],
        all_gather_exposed_ns=shares["all_gather_exposed"],
        reduce_exposed_ns=shares["reduce_exposed"],
        optimizer_ns=shares["optimizer"],
        other_ns=shares["other"],
    )
