"""A timeline as Chrome Trace Event Format JSON: what Perfetto (ui.perfetto.dev) and
chrome://tracing open (lanes and fields: ``docs/timeline.md``). A track draws only nested
slices, so a lane of collectives in flight, which may overlap one another, is split into as
many numbered sub-lanes as the overlap needs (``all-gather #2``).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from mfsdp_hooks.runtime.timeline_events import TimelineEvent, TimelineStep

__all__ = ["LANES", "chrome_trace"]

LANES = (
    "steps",
    "compute",
    "optimizer",
    "all-gather",
    "reduce-scatter",
    "all-gather (device)",
    "reduce-scatter (device)",
)
"""The lanes in display order; lane ``i``'s sub-lane ``k`` is thread ``100 * i + k``."""
_NESTED = {"steps", "compute", "optimizer"}  # slices there nest by construction


def _us(ns: int) -> float:
    return ns / 1000.0


def _name(event: TimelineEvent) -> str:
    return event.kind.value + (f" {event.unit}" if event.unit else "")


def _sub_lanes(events: Iterable[TimelineEvent]) -> list[tuple[TimelineEvent, int]]:
    """Each interval with the first sub-lane free at its start (greedy colouring)."""
    ends: list[int] = []
    placed = []
    for event in sorted(events, key=lambda e: (e.start_ns, e.end_ns)):
        lane = next((i for i, end in enumerate(ends) if end <= event.start_ns), len(ends))
        if lane == len(ends):
            ends.append(event.end_ns)
        ends[lane] = event.end_ns
        placed.append((event, lane))
    return placed


def _complete(
    name: str, start_ns: int, end_ns: int, pid: int, tid: int, args: dict[str, Any]
) -> dict[str, Any]:
    return {
        "name": name,
        "cat": "mfsdp",
        "ph": "X",
        "ts": _us(start_ns),
        "dur": _us(end_ns - start_ns),
        "pid": pid,
        "tid": tid,
        "args": args,
    }


def _metadata(pid: int, tid: int, name: str, value: str | int) -> dict[str, Any]:
    key = "sort_index" if name.endswith("sort_index") else "name"
    return {"name": name, "ph": "M", "pid": pid, "tid": tid, "args": {key: value}}


def _step_events(step: TimelineStep, rank: int, origin_ns: int) -> list[dict[str, Any]]:
    """The step's own slice (its host-time shares as arguments), then its events."""
    shares = {f"{k}_us": _us(v) for k, v in step.host_time().items()}
    out = [
        _complete(
            f"step {step.index}",
            step.start_ns - origin_ns,
            step.end_ns - origin_ns,
            rank,
            0,
            {"step": step.index, **shares},
        )
    ]
    by_lane: dict[str, list[TimelineEvent]] = {}
    for event in step.events:
        by_lane.setdefault(event.kind.lane, []).append(event)
    for lane, events in by_lane.items():
        placed = [(e, 0) for e in events] if lane in _NESTED else _sub_lanes(events)
        base = 100 * LANES.index(lane)
        for event, sub in placed:
            args: dict[str, Any] = {"step": step.index, "unit": event.unit}
            if event.kind.category is not None:
                args["self_us"] = _us(event.self_ns)
            start, end = event.start_ns - origin_ns, event.end_ns - origin_ns
            out.append(_complete(_name(event), start, end, rank, base + sub, args))
    return out


def chrome_trace(steps: Sequence[TimelineStep], rank: int, origin_ns: int) -> dict[str, Any]:
    """``{"traceEvents": [...], "displayTimeUnit": "ms"}`` for one rank's steps; times are
    microseconds since ``origin_ns`` (the trace's start on this rank)."""
    records = [record for step in steps for record in _step_events(step, rank, origin_ns)]
    threads = sorted({record["tid"] for record in records} | {0, 100})
    meta = [
        _metadata(rank, 0, "process_name", f"rank {rank}"),
        _metadata(rank, 0, "process_sort_index", rank),
    ]
    for tid in threads:
        lane, sub = LANES[tid // 100], tid % 100
        meta.append(_metadata(rank, tid, "thread_name", lane + (f" #{sub + 1}" if sub else "")))
        meta.append(_metadata(rank, tid, "thread_sort_index", tid))
    return {"traceEvents": meta + records, "displayTimeUnit": "ms"}
