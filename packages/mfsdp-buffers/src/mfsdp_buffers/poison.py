"""Debug poisoning: memory the engine hands back is filled with a value no step produces.

A stale view of a released buffer would otherwise read the right numbers from a moment ago
and the bug stay silent; poisoned, it reads NaN (or an integer dtype's max). One fill per
release, only while on (the package README, "Poisoning released buffers").
"""

from __future__ import annotations

import contextlib
from collections.abc import Hashable, Iterator

import torch

from mfsdp_buffers.allocators.protocol import Allocator

__all__ = [
    "is_poisoned",
    "poison_",
    "poisoning_released_buffers",
    "poisoning_enabled",
    "release_to",
]

_enabled: list[bool] = [False]  # one process-wide switch, flipped only by the context below


def poisoning_enabled() -> bool:
    return _enabled[0]


@contextlib.contextmanager
def poisoning_released_buffers(enabled: bool = True) -> Iterator[None]:
    """Poison every buffer handed back through ``release_to`` while the block runs."""
    previous, _enabled[0] = _enabled[0], bool(enabled)
    try:
        yield
    finally:
        _enabled[0] = previous


def _pattern(dtype: torch.dtype) -> float | int | bool:
    if dtype.is_floating_point or dtype.is_complex:
        return float("nan")
    if dtype == torch.bool:
        return True
    return int(torch.iinfo(dtype).max)


def poison_(tensor: torch.Tensor) -> torch.Tensor:
    """Fill ``tensor`` in place with NaN (floating point) or its dtype's max (integers)."""
    with torch.no_grad():
        return tensor.fill_(_pattern(tensor.dtype))


def is_poisoned(tensor: torch.Tensor) -> bool:
    """Whether every element still holds the poison pattern."""
    if tensor.dtype.is_floating_point or tensor.dtype.is_complex:
        return bool(torch.isnan(tensor).all())
    return bool((tensor == _pattern(tensor.dtype)).all())


def release_to(allocator: Allocator, key: Hashable, tensor: torch.Tensor) -> None:
    """Give ``tensor`` back to ``allocator``, poisoned first when poisoning is on."""
    if _enabled[0] and tensor.untyped_storage().nbytes() > 0:
        poison_(tensor)
    allocator.free(key, tensor)
