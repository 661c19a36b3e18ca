"""Which side of the host/device line a tensor's storage lives on: the one owner of it
(``describe`` reads it of the engine's buffers, ``LiveTensorTracker`` counts by it).

While an accelerator computes, a CPU storage lives on the host. Where the CPU stands in for
the accelerator (forced host copies in tests, a plan's fake run) both sides are CPU tensors:
there a storage is the host's when its maker said so (:func:`mark_host`), or, to a tracker,
when an op made it from host storages alone (the optimizer's state, like its parameters).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable

import torch

__all__ = ["host_side", "mark_host", "marked_host", "on_host"]

_HOST: weakref.WeakSet[torch.UntypedStorage] = weakref.WeakSet()
# Open trackers, told of a storage marked after they counted it (on the device side).
_LISTENERS: list[Callable[[torch.UntypedStorage], None]] = []


def mark_host(tensor: torch.Tensor) -> torch.Tensor:
    """Record that ``tensor``'s storage is host memory apart from the compute device (made
    by host offload), and return it."""
    storage = tensor.untyped_storage()
    _HOST.add(storage)
    for listener in list(_LISTENERS):
        listener(storage)
    return tensor


def marked_host(storage: torch.UntypedStorage) -> bool:
    """Whether ``storage`` was made as host memory (:func:`mark_host`)."""
    return storage in _HOST


def host_side(where: torch.device, device: torch.device) -> bool:
    """Whether memory on ``where`` is the host's, apart from ``device`` that computes: a CPU
    while an accelerator computes (where the CPU computes, only :func:`mark_host` tells)."""
    return where.type == "cpu" and device.type != "cpu"


def on_host(tensor: torch.Tensor, device: torch.device) -> bool:
    """Whether ``tensor`` lives on the host while ``device`` computes (module docstring)."""
    return host_side(tensor.device, device) or marked_host(tensor.untyped_storage())


def listen(listener: Callable[[torch.UntypedStorage], None]) -> None:
    """``listener(storage)`` on each :func:`mark_host` until :func:`unlisten` (trackers)."""
    _LISTENERS.append(listener)


def unlisten(listener: Callable[[torch.UntypedStorage], None]) -> None:
    _LISTENERS.remove(listener)
