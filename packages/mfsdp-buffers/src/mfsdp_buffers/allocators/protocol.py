"""The one interface through which buffers obtain temporary (unsharded) storage, so memory
policy can change without touching buffer code."""

from __future__ import annotations

from collections.abc import Hashable
from typing import Protocol, runtime_checkable

import torch


@runtime_checkable
class Allocator(Protocol):
    """Hands out 1-D tensors for a caller-chosen ``key`` and takes them back.

    ``key`` names the requester (e.g. one buffer) and must be stable across
    iterations: pooled allocators use it to recognise repeated requests. A
    tensor passed to :meth:`free` must be the one :meth:`allocate` returned and
    must not be used afterwards (its bytes may be handed to someone else).
    """

    def allocate(
        self, key: Hashable, numel: int, dtype: torch.dtype, device: torch.device
    ) -> torch.Tensor:
        """Return a 1-D tensor of ``numel`` elements; its contents are undefined."""
        ...

    def free(self, key: Hashable, tensor: torch.Tensor) -> None:
        """Give ``tensor`` (obtained from :meth:`allocate` with ``key``) back."""
        ...


def has_stable_storage(allocator: Allocator) -> bool:
    """Whether ``allocate`` returns the same tensor object and storage for a key every time.

    When true, views taken once (``nn.Parameter.data``, tensors saved by
    autograd) stay valid across free/allocate cycles, so the engine does not
    need to re-point parameters after every gather. Read from an optional
    ``stable_storage`` class attribute so third-party allocators need not define it.
    """
    return bool(getattr(allocator, "stable_storage", False))


def allocate_checked(
    allocator: Allocator, key: Hashable, numel: int, dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """``allocator.allocate(key, numel, dtype, device)``, its answer checked. The buffer goes
    straight to collectives that trust the layout it was asked for (their checks ran once,
    where the engine laid its buffers out); a buffer of another shape, dtype or device, or not
    contiguous, would read or write the wrong bytes, so it raises here, naming the allocator."""
    tensor = allocator.allocate(key, numel, dtype, device)
    if (
        not isinstance(tensor, torch.Tensor)
        or tensor.dim() != 1
        or tensor.numel() != numel
        or tensor.dtype != dtype
        or tensor.device.type != device.type
        or (device.index is not None and tensor.device.index != device.index)
        or not tensor.is_contiguous()
    ):
        got = (
            f"shape {tuple(tensor.shape)} dtype {tensor.dtype} on {tensor.device}"
            + ("" if tensor.is_contiguous() else ", not contiguous")
            if isinstance(tensor, torch.Tensor)
            else type(tensor).__name__
        )
        raise RuntimeError(
            f"{type(allocator).__name__} returned {got}; expected ({numel},) {dtype} on "
            f"{device}, contiguous"
        )
    return tensor


def check_request(numel: int, dtype: torch.dtype, device: torch.device) -> None:
    """Reject malformed requests with a clear message before any memory is touched."""
    if isinstance(numel, bool) or not isinstance(numel, int) or numel < 0:
        raise ValueError(f"numel must be a non-negative int, got {numel!r}")
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"dtype must be a torch.dtype, got {dtype!r}")
    if not isinstance(device, torch.device):
        raise TypeError(f"device must be a torch.device, got {device!r}")
