"""One pool sized for the largest request: ``num_slots`` persistent slots per dtype and device
(the reference's ``megatron_fsdp_max_pool_double_buffer``; the package README, "Allocators").
A slot grows (is replaced by a larger one) only while free.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import ClassVar

import torch

from mfsdp_buffers.allocators.protocol import check_request
from mfsdp_buffers.allocators.slot_pool import SlotPoolBase

_DtypeClass = tuple[torch.dtype, torch.device]


@dataclass
class _Slot:
    storage: torch.Tensor
    lent: torch.Tensor | None = None  # the view handed out, while held
    holder: Hashable | None = None


@dataclass
class _Slots:
    slots: list[_Slot] = field(default_factory=list)
    next: int = 0


class MaxPoolAllocator(SlotPoolBase[_DtypeClass, _Slots]):
    """``num_slots`` persistent tensors per ``(dtype, device)``, each grown to the largest
    request; requests are served round-robin with the front ``numel`` elements of a slot."""

    stable_storage: ClassVar[bool] = False

    def allocate(
        self, key: Hashable, numel: int, dtype: torch.dtype, device: torch.device
    ) -> torch.Tensor:
        check_request(numel, dtype, device)
        pool = self._classes.setdefault((dtype, device), _Slots())
        for step in range(self.num_slots):
            i = (pool.next + step) % self.num_slots
            if i == len(pool.slots):
                pool.slots.append(_Slot(self._new_storage(numel, dtype, device)))
            slot = pool.slots[i]
            if slot.lent is not None:
                continue
            if slot.storage.numel() < numel:  # free and too small: grow it
                slot.storage = self._new_storage(numel, dtype, device)
            slot.lent, slot.holder = slot.storage[:numel], key
            pool.next = (i + 1) % self.num_slots
            return slot.lent
        holders = [s.holder for s in pool.slots]
        why = (
            f"MaxPoolAllocator: all {self.num_slots} slots of {dtype} on {device} are in use "
            f"(held by {holders!r}); free one first or raise num_slots"
        )
        return self.fallback.allocate(key, numel, dtype, device, why)

    def free(self, key: Hashable, tensor: torch.Tensor) -> None:
        if self.fallback.free(tensor):
            return
        pool = self._classes.get((tensor.dtype, tensor.device))
        for slot in pool.slots if pool is not None else ():
            if slot.lent is tensor:
                slot.lent, slot.holder = None, None
                return
        raise RuntimeError(f"free({key!r}): tensor is not lent out by this pool")

    def reserved_bytes(self) -> int:
        """Bytes this pool keeps between requests: its slots and persistent fallbacks."""
        slots = sum(
            s.storage.numel() * s.storage.element_size()
            for pool in self._classes.values()
            for s in pool.slots
        )
        return slots + self.fallback.reserved_bytes()
