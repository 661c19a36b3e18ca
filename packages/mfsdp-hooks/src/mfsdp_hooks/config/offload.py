"""Host offload (FSDP2's ``CPUOffloadPolicy``): the one owner of what crosses between the
host and the device, and of when.

[Note: host offload] With ``offload_policy=CPUOffloadPolicy()`` while an accelerator computes,
each parameter group keeps its optimizer-facing weights (main weights, always apart from the
compute weights, so no compute-dtype shard persists on the device), its reduced gradients and
so the optimizer's state on the host, in page-locked memory when ``pin_memory``. The device
holds what it computes with, only while it computes:

* weights: before each all-gather of a unit, its host shard is copied to the device and
  encoded into its slot of the unsharded buffer (``HostOffload.encode_to_device``), on the
  all-gather stream, so the copy is ordered before the all-gather that reads it and overlaps
  compute as the all-gather does (prefetched with it);
* gradients: a reduction writes into a device staging buffer (``GradLanding.stage``; it holds
  the host gradients only when the reduction adds to them), and once it landed the staging
  buffer is copied back into the host gradients (``GradLanding.land``) on the reduce-scatter
  stream, non-blocking into pinned memory. The host waits for those copies when the backward
  ends (``GradLanding.settle``, as FSDP2's ``finalize_backward``), before any optimizer, the
  NaN check or the next reduction into the same gradients reads them;
* the optimizer then steps on the host, and the next gather copies the stepped shard over.

On CPU the host is the device: the policy is honoured as it stands, nothing moves. Tests run
the same path there with every copy made (``forced_host_copies``): the "device" buffers and
the "host" shards are distinct tensors, and ``CopyCounts`` counts each copy and its bytes.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from mfsdp_collectives import CommStreams
from mfsdp_collectives.issuing.streams import current_stream
from mfsdp_hooks.config.codec import IDENTITY, ParamCodec

__all__ = [
    "CopyCounts",
    "GradLanding",
    "HostOffload",
    "encode_main",
    "forced_host_copies",
]

_FORCED: list[bool] = [False]


@contextlib.contextmanager
def forced_host_copies() -> Iterator[None]:
    """Tests, and a plan's fake run where the CPU stands in for an accelerator
    (``megatron_fsdp.plan``): a ``CPUOffloadPolicy`` given to a model on CPU inside the block
    runs the offload path with every copy made, as on an accelerator (read at wrap time)."""
    previous, _FORCED[0] = _FORCED[0], True
    try:
        yield
    finally:
        _FORCED[0] = previous


def host_copies_forced() -> bool:
    return _FORCED[0]


@dataclass
class CopyCounts:
    """The copies a ``HostOffload`` made, and their bytes (what the bytes were on the side
    they came from)."""

    to_device: int = 0
    to_device_bytes: int = 0
    to_host: int = 0
    to_host_bytes: int = 0

    def reset(self) -> None:
        self.to_device = self.to_device_bytes = self.to_host = self.to_host_bytes = 0


class HostOffload:
    """Where the host copies of one ``fully_shard`` call go, how, and how many were made."""

    def __init__(self, device: torch.device, *, pin_memory: bool) -> None:
        """``device``: the compute device (CPU only when the copies are forced)."""
        self.device = device
        self.host = torch.device("cpu")
        # Page-locked memory needs an accelerator; a forced run on CPU has none to copy with.
        self.pin_memory = bool(pin_memory) and device.type != "cpu"
        self._asked_pinned = bool(pin_memory)
        self.counts = CopyCounts()

    def __repr__(self) -> str:  # no address: the ranks compare it when they agree on a wrap
        return f"HostOffload(device_type={self.device.type}, pin_memory={self._asked_pinned})"

    def to_device(self, source: torch.Tensor, out: torch.Tensor) -> None:
        """One host -> device copy, counted (on the stream current to the caller)."""
        out.copy_(source, non_blocking=self.pin_memory)
        self.counts.to_device += 1
        self.counts.to_device_bytes += source.numel() * source.element_size()

    def to_host(self, source: torch.Tensor, out: torch.Tensor) -> None:
        """One device -> host copy, counted (on the stream current to the caller)."""
        out.copy_(source, non_blocking=self.pin_memory)
        self.counts.to_host += 1
        self.counts.to_host_bytes += source.numel() * source.element_size()

    def encode_to_device(
        self,
        codec: ParamCodec,
        source: torch.Tensor,
        out: torch.Tensor,
        streams: CommStreams | None,
    ) -> None:
        """Copy the host shard ``source`` to the device and encode it into ``out`` (this
        rank's slot of the buffer the all-gather fills next), on the all-gather stream."""
        with _side_stream(streams, "all_gather", self.device), torch.no_grad():
            if codec is IDENTITY and source.dtype == out.dtype:
                self.to_device(source, out)
                return
            staged = torch.empty(source.shape, dtype=source.dtype, device=self.device)
            self.to_device(source, staged)
            codec.encode(staged, out)


def encode_main(
    codec: ParamCodec,
    offload: HostOffload | None,
    source: torch.Tensor,
    out: torch.Tensor,
    streams: CommStreams | None,
) -> None:
    """Encode main weights ``source`` into compute weights ``out``: across from the host
    when they live there (``offload``), in place otherwise."""
    if offload is not None:
        offload.encode_to_device(codec, source, out, streams)
        return
    with torch.no_grad():
        codec.encode(source, out)


class GradLanding:
    """One parameter group's reduced gradients on their way to the host (see the note)."""

    def __init__(self, offload: HostOffload) -> None:
        self.offload = offload
        self._host: torch.Tensor | None = None  # the gradients the reduction in flight is for
        self._staged: torch.Tensor | None = None  # on the device, until its copy landed
        self._event: torch.Event | None = None  # the copy to the host, when non-blocking

    def stage(self, host: torch.Tensor, accumulate: bool) -> tuple[torch.Tensor, bool]:
        """The device buffer a reduction into the host gradients ``host`` writes, and whether
        it adds to it (then it starts as a copy of them)."""
        self.settle()  # a copy into ``host`` still in flight lands before it is read again
        offload = self.offload
        staged = torch.empty(host.shape, dtype=host.dtype, device=offload.device)
        if accumulate:
            with torch.no_grad():
                offload.to_device(host, staged)
        self._host, self._staged = host, staged
        return staged, accumulate

    def after(self, release: Callable[[], None], streams: CommStreams | None) -> Callable[[], None]:
        """``release`` (a plan's, run once the reduction landed), then the copy home."""

        def release_and_land() -> None:
            release()
            self.land(streams)

        return release_and_land

    def land(self, streams: CommStreams | None) -> None:
        """Copy the landed reduction to the host gradients, on the reduce-scatter stream."""
        host, staged, self._host = self._host, self._staged, None
        if host is None or staged is None:
            return
        offload = self.offload
        side = _active(streams, "reduce_scatter")
        with _side_stream(streams, "reduce_scatter", offload.device), torch.no_grad():
            offload.to_host(staged, host)
        if side is None:
            self._staged = None
        else:  # ``staged`` stays alive until the copy's event fired
            self._event = side.record_event()

    def settle(self) -> None:
        """Block the host until the copy home landed (a no-op when none is in flight)."""
        event, self._event = self._event, None
        if event is not None:
            event.synchronize()
        if self._host is None:  # a reduction staged but not landed yet keeps its buffer
            self._staged = None


def _active(streams: CommStreams | None, role: str) -> torch.Stream | None:
    if streams is None or not streams.active:
        return None
    stream: torch.Stream | None = getattr(streams, role)
    return stream


@contextlib.contextmanager
def _side_stream(streams: CommStreams | None, role: str, device: torch.device) -> Iterator[None]:
    """Run the block on the ``role`` side stream, ordered after what the caller's stream
    issued (the buffers it reads or writes were made there); on the host without streams."""
    side = _active(streams, role)
    if side is None:
        yield
        return
    side.wait_stream(current_stream(device))
    with side:
        yield
