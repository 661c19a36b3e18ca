"""Buffers the quantized collectives reuse from call to call: a large fresh tensor costs a
page fault and a zeroing per page (on a CPU about a pass over it), and a quantized
reduce-scatter needs four (scaled values, send and receive payloads, the sum).

- **scratch**: one fp32 tensor per thread, grown to the largest request, borrowed and returned
  within one call on that thread, so one per thread serves any number of collectives in
  flight (the training thread's and a ``CollectiveWorker``'s each have their own).
- **payloads**: uint8 tensors lent to a collective until it lands (``give_back``); at most
  ``keep`` free ones are kept per shape, so memory stays bounded.
"""

from __future__ import annotations

import threading

import torch

__all__ = ["QuantizationBuffers"]


class QuantizationBuffers:
    """Reused scratch and payload tensors of the quantized collectives (module docstring)."""

    def __init__(self, keep: int = 2) -> None:
        if isinstance(keep, bool) or not isinstance(keep, int) or keep < 0:
            raise ValueError(f"keep={keep!r} must be an int >= 0 (free payloads kept per shape)")
        self._keep = keep
        self._lock = threading.Lock()
        self._free: dict[tuple[int, int], list[torch.Tensor]] = {}
        self._per_thread = threading.local()
        self._scratches: list[torch.Tensor] = []  # every thread's, for held_bytes

    def scratch(self, numel: int) -> torch.Tensor:
        """This thread's fp32 scratch of ``numel`` values, valid until its next call."""
        mine: torch.Tensor | None = getattr(self._per_thread, "scratch", None)
        if mine is None or mine.numel() < numel:
            grown = torch.empty(numel, dtype=torch.float32)
            with self._lock:
                self._scratches = [t for t in self._scratches if t is not mine] + [grown]
            self._per_thread.scratch = mine = grown
        return mine[:numel]

    def payloads(self, rows: int, nbytes: int) -> torch.Tensor:
        """A ``(rows, nbytes)`` uint8 tensor (contents undefined), lent until ``give_back``."""
        with self._lock:
            free = self._free.get((rows, nbytes))
            if free:
                return free.pop()
        return torch.empty(rows, nbytes, dtype=torch.uint8)

    def give_back(self, payloads: torch.Tensor) -> None:
        """Return a tensor from ``payloads``; the caller no longer reads or writes it."""
        with self._lock:
            free = self._free.setdefault((payloads.shape[0], payloads.shape[1]), [])
            if len(free) < self._keep:
                free.append(payloads)

    def held_bytes(self) -> int:
        """Bytes kept between calls (every thread's scratch and the free payloads)."""
        with self._lock:
            kept = sum(t.numel() for free in self._free.values() for t in free)
            return 4 * sum(t.numel() for t in self._scratches) + kept
