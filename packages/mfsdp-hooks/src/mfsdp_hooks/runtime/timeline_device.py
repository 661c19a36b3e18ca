"""CUDA only: when a timeline's collectives ran on their side streams, not just when the host
issued them (an accelerator's issue returns at once and its wait only orders streams).

Per issue, one event on the compute stream before it (the collective cannot start earlier)
and one on its side stream after it (it is done there); they are read when the trace ends
and placed on the host clock through one reference event synchronised at the first mark.
Nothing here runs on CPU, so the CPU test suite exercises none of it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from mfsdp_collectives import CommStreams

__all__ = ["DeviceClock", "DeviceInterval", "DeviceMark"]


@dataclass(frozen=True)
class DeviceMark:
    """An issue in progress: the event before it and the streams it was issued on."""

    started: torch.Event
    streams: CommStreams


@dataclass(frozen=True)
class DeviceInterval:
    """When one collective ran on the device, in host ``perf_counter_ns`` time."""

    kind: str
    unit: str
    step: int
    start_ns: int
    end_ns: int


class DeviceClock:
    """Marks collectives on CUDA side streams and resolves them when the trace ends."""

    def __init__(self) -> None:
        self._origin: tuple[torch.Event, int] | None = None
        self._marks: list[tuple[str, str, int, torch.Event, torch.Event]] = []

    @staticmethod
    def _timed_event(device: torch.device) -> torch.Event:
        return torch.Event(device=device, enable_timing=True)

    def begin(self, streams: CommStreams | None) -> DeviceMark | None:
        """An event on the compute stream before an issue (None off CUDA side streams)."""
        if streams is None or not streams.active or streams.device.type != "cuda":
            return None
        if not torch.cuda.is_available():
            return None
        compute = torch.accelerator.current_stream(streams.device)
        if self._origin is None:
            origin = self._timed_event(streams.device)
            origin.record(compute)
            origin.synchronize()
            self._origin = (origin, time.perf_counter_ns())
        started = self._timed_event(streams.device)
        started.record(compute)
        return DeviceMark(started, streams)

    def end(self, mark: DeviceMark, kind: str, unit: str, step: int, role: str) -> None:
        """An event on the side stream ``role`` (``all_gather``/``reduce_scatter``) after the
        issue: the collective is done on the device when it completes."""
        stream = getattr(mark.streams, role)
        if stream is None:
            return
        ended = self._timed_event(mark.streams.device)
        ended.record(stream)
        self._marks.append((kind, unit, step, mark.started, ended))

    def resolve(self) -> list[DeviceInterval]:
        """Every marked collective on the host clock (synchronises each end event once)."""
        if self._origin is None:
            return []
        origin, origin_ns = self._origin
        found = []
        for kind, unit, step, started, ended in self._marks:
            ended.synchronize()
            start_ns = origin_ns + int(origin.elapsed_time(started) * 1e6)
            end_ns = origin_ns + int(origin.elapsed_time(ended) * 1e6)
            found.append(DeviceInterval(kind, unit, step, start_ns, end_ns))
        self._marks = []
        return found
