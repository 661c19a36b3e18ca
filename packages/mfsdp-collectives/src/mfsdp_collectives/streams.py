"""Dedicated side streams for communication on accelerators.

A collective issued on the compute stream serialises with compute; issued on
its own stream it overlaps. FSDP needs one stream per direction so a prefetched
all-gather is never queued behind a reduce-scatter (and one more for the HSDP
inter-node hop so the outer all-reduce does not block the next intra-node
reduce-scatter). On CPU there are no streams: gloo's async work objects give
the overlap, so ``CommStreams`` is inert there.
"""

from __future__ import annotations

import torch

__all__ = ["CommStreams"]


class CommStreams:
    """The all-gather, reduce-scatter and outer (HSDP) side streams for one device.

    ``active`` is False on CPU (or with ``enabled=False``), and the stream
    attributes are then None; ops given an inactive ``CommStreams`` behave as if
    given none.
    """

    def __init__(self, device: torch.device | str, *, enabled: bool = True) -> None:
        dev = torch.device(device) if isinstance(device, str) else device
        if not isinstance(dev, torch.device):
            raise TypeError(f"device must be a torch.device or a string, got {type(device)}")
        self.device = dev
        self.active = bool(enabled) and dev.type != "cpu"
        self.all_gather: torch.Stream | None = None
        self.reduce_scatter: torch.Stream | None = None
        self.outer: torch.Stream | None = None
        if self.active:
            self.all_gather = torch.Stream(device=dev)
            self.reduce_scatter = torch.Stream(device=dev)
            self.outer = torch.Stream(device=dev)

    def __repr__(self) -> str:
        return f"CommStreams(device={self.device}, active={self.active})"


def current_stream(device: torch.device) -> torch.Stream:
    """The stream compute is currently issued on for ``device``."""
    return torch.accelerator.current_stream(device)
