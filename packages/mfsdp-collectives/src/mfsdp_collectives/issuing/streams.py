"""Dedicated side streams for communication on accelerators (inert on CPU, where gloo's
async work objects give the overlap). One stream per direction, so a prefetched all-gather
never queues behind a reduce-scatter, and one for the HSDP outer hop, so the outer all-reduce
does not block the next intra-node reduce-scatter. Streams come from a
``StreamBackend``: torch's own, or in tests ``stream_sim``'s stand-ins.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Protocol

import torch

from ..core._compat import Work

__all__ = ["CommStreams", "StreamBackend", "current_stream", "using_stream_backend"]


class StreamBackend(Protocol):
    """Where streams come from, and what a collective on a stream declares it touches."""

    def provides_streams(self, device: torch.device) -> bool:
        """Whether ``device`` gets side streams (accelerators; CPU only when simulated)."""
        ...

    def new_stream(self, device: torch.device, role: str) -> torch.Stream: ...

    def current_stream(self, device: torch.device) -> torch.Stream: ...

    def note_collective(
        self,
        stream: torch.Stream,
        reads: Sequence[torch.Tensor],
        writes: Sequence[torch.Tensor],
    ) -> None:
        """A collective on ``stream`` reads and writes these (real streams: nothing to do;
        the bytes a backend moves are invisible to anything watching tensor ops)."""
        ...

    def wait_work(self, work: Work) -> None:
        """Make the current stream wait for ``work``; its backend's own temporaries are the
        backend's business (a simulator does not track them)."""
        ...


class _AcceleratorStreams:
    """torch's streams: what runs outside tests."""

    def provides_streams(self, device: torch.device) -> bool:
        return device.type != "cpu"

    def new_stream(self, device: torch.device, role: str) -> torch.Stream:
        return torch.Stream(device=device)

    def current_stream(self, device: torch.device) -> torch.Stream:
        return torch.accelerator.current_stream(device)

    def note_collective(
        self,
        stream: torch.Stream,
        reads: Sequence[torch.Tensor],
        writes: Sequence[torch.Tensor],
    ) -> None:
        return None

    def wait_work(self, work: Work) -> None:
        work.wait()


_backend: list[StreamBackend] = [_AcceleratorStreams()]


def stream_backend() -> StreamBackend:
    return _backend[0]


@contextlib.contextmanager
def using_stream_backend(backend: StreamBackend) -> Iterator[None]:
    """Take streams from ``backend`` while the block runs (``CommStreams`` built inside it)."""
    previous, _backend[0] = _backend[0], backend
    try:
        yield
    finally:
        _backend[0] = previous


class CommStreams:
    """The all-gather, reduce-scatter and outer (HSDP) side streams for one device; on CPU
    (or ``enabled=False``) not ``active``, the streams None, as good as none given."""

    def __init__(self, device: torch.device | str, *, enabled: bool = True) -> None:
        dev = torch.device(device) if isinstance(device, str) else device
        if not isinstance(dev, torch.device):
            raise TypeError(f"device must be a torch.device or a string, got {type(device)}")
        self.device = dev
        backend = stream_backend()
        self.active = bool(enabled) and backend.provides_streams(dev)
        self.all_gather: torch.Stream | None = None
        self.reduce_scatter: torch.Stream | None = None
        self.outer: torch.Stream | None = None
        if self.active:
            self.all_gather = backend.new_stream(dev, "all_gather")
            self.reduce_scatter = backend.new_stream(dev, "reduce_scatter")
            self.outer = backend.new_stream(dev, "outer")

    def __repr__(self) -> str:
        return f"CommStreams(device={self.device}, active={self.active})"


def current_stream(device: torch.device) -> torch.Stream:
    """The stream compute is currently issued on for ``device``."""
    return stream_backend().current_stream(device)
