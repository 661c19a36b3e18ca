"""Per-rank memory figures from whatever the device offers: one interface for CPU and CUDA.

CPU has no allocator statistics, so live tensor bytes come from ``LiveTensorTracker`` and the
resident set from the kernel; CUDA has exact allocator counters. Both give the same phase
marks (live bytes at the end of a phase, peak during it) so reports need no special case.
"""

from __future__ import annotations

import contextlib
import resource
from pathlib import Path
from types import TracebackType
from typing import Protocol

import torch

from mfsdp_buffers import LiveTensorTracker, PhaseMark

__all__ = [
    "CudaMemoryProbe",
    "MemoryProbe",
    "make_probe",
    "reset_rss_high_water",
    "rss_high_water_kib",
    "rss_lifetime_max_kib",
]


class MemoryProbe(Protocol):
    peak: int
    marks: list[PhaseMark]

    def __enter__(self) -> MemoryProbe: ...

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None: ...

    def reset_phase(self) -> None: ...

    def mark(self, name: str) -> PhaseMark: ...


class CudaMemoryProbe:
    """Phase marks from ``torch.cuda.memory_allocated``/``max_memory_allocated``."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.peak = 0
        self.marks: list[PhaseMark] = []

    def __enter__(self) -> CudaMemoryProbe:
        torch.cuda.reset_peak_memory_stats(self.device)
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.peak = max(self.peak, torch.cuda.max_memory_allocated(self.device))

    def reset_phase(self) -> None:
        torch.cuda.synchronize(self.device)
        self.peak = max(self.peak, torch.cuda.max_memory_allocated(self.device))
        torch.cuda.reset_peak_memory_stats(self.device)

    def mark(self, name: str) -> PhaseMark:
        torch.cuda.synchronize(self.device)
        phase_peak = torch.cuda.max_memory_allocated(self.device)
        self.peak = max(self.peak, phase_peak)
        mark = PhaseMark(name, torch.cuda.memory_allocated(self.device), phase_peak, None)
        self.marks.append(mark)
        torch.cuda.reset_peak_memory_stats(self.device)
        return mark


def make_probe(device: torch.device) -> MemoryProbe:
    if device.type == "cuda":
        return CudaMemoryProbe(device)
    return LiveTensorTracker(attribute=True, skip_sites=("comm_count.py",))


def rss_lifetime_max_kib() -> int:
    """``ru_maxrss``: the process's resident-set high-water mark (KiB on Linux).

    A rank forked from the harness's forkserver starts from that server's high-water mark
    (torch imported), which is the same for every implementation.
    """
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)


def reset_rss_high_water() -> bool:
    """Restart the kernel's ``VmHWM`` (Linux >= 4.0) so it covers only what follows."""
    with contextlib.suppress(OSError):
        Path("/proc/self/clear_refs").write_text("5")
        return True
    return False


def rss_high_water_kib() -> int | None:
    """``VmHWM`` from ``/proc/self/status``: the peak RSS since the last reset, or None."""
    with contextlib.suppress(OSError):
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1])
    return None
