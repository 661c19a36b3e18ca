"""One tensor per key whose storage is shrunk to zero bytes on free and regrown on allocate."""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass
from typing import ClassVar

import torch

from mfsdp_buffers.allocators.protocol import check_request


@dataclass
class _Slot:
    tensor: torch.Tensor
    nbytes: int
    live: bool


class StorageResizeAllocator:
    """Default for model-weight unsharded buffers.

    ``free`` releases the bytes at once with ``untyped_storage().resize_(0)``
    instead of waiting for Python references (parameter ``.data`` views,
    autograd-saved tensors) to die. ``allocate`` regrows that same storage, so
    the tensor object and every view of it stay valid across cycles: the engine
    points parameters at the unsharded buffer once. Contents after regrowth are
    undefined (the caller all-gathers into them).
    """

    stable_storage: ClassVar[bool] = True

    def __init__(self) -> None:
        self._slots: dict[Hashable, _Slot] = {}

    def allocate(
        self, key: Hashable, numel: int, dtype: torch.dtype, device: torch.device
    ) -> torch.Tensor:
        check_request(numel, dtype, device)
        slot = self._slots.get(key)
        if slot is None:
            tensor = torch.empty(numel, dtype=dtype, device=device)
            self._slots[key] = _Slot(tensor, tensor.untyped_storage().nbytes(), live=True)
            return tensor
        t = slot.tensor
        if t.numel() != numel or t.dtype != dtype or t.device != device:
            raise ValueError(
                f"key {key!r} was first allocated as ({t.numel()}, {t.dtype}, {t.device}) "
                f"and is now requested as ({numel}, {dtype}, {device}); use a distinct key per "
                "buffer"
            )
        if slot.live:
            raise RuntimeError(
                f"key {key!r} is already allocated; free it before allocating it again"
            )
        t.untyped_storage().resize_(slot.nbytes)
        slot.live = True
        return t

    def free(self, key: Hashable, tensor: torch.Tensor) -> None:
        slot = self._slots.get(key)
        if slot is None or slot.tensor is not tensor:
            raise RuntimeError(f"free({key!r}): tensor was not allocated by this allocator")
        if not slot.live:
            raise RuntimeError(f"free({key!r}): already freed")
        tensor.untyped_storage().resize_(0)
        slot.live = False

    def is_live(self, key: Hashable) -> bool:
        """Whether ``key`` currently holds memory."""
        slot = self._slots.get(key)
        return slot is not None and slot.live
