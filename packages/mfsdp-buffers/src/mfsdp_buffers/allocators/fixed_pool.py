"""Persistent double (or N-) buffering: a fixed set of slots per size class, reused round-robin."""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import ClassVar

import torch

from mfsdp_buffers.allocators.protocol import check_request
from mfsdp_buffers.allocators.slot_pool import SlotPoolBase

_SizeClass = tuple[int, torch.dtype, torch.device]


@dataclass
class _Slots:
    tensors: list[torch.Tensor] = field(default_factory=list)
    holders: list[Hashable | None] = field(default_factory=list)
    next: int = 0


class FixedPoolAllocator(SlotPoolBase[_SizeClass, _Slots]):
    """``num_slots`` persistent tensors per ``(numel, dtype, device)``, handed out round-robin.

    The memory is allocated once and never returned, which is what registered
    communication buffers (NCCL user buffers, symmetric memory) need: the
    registration is done once on the slot's storage, through ``factory``
    (e.g. allocate inside a registered memory pool). Running out of slots is a
    scheduling bug upstream (too many gathers in flight), so by default it raises
    instead of silently allocating unregistered memory; ``on_full`` may instead
    allocate dynamically or keep a persistent buffer per requester
    (:mod:`mfsdp_buffers.allocators.fallback`).
    """

    stable_storage: ClassVar[bool] = False

    def allocate(
        self, key: Hashable, numel: int, dtype: torch.dtype, device: torch.device
    ) -> torch.Tensor:
        check_request(numel, dtype, device)
        slots = self._classes.setdefault((numel, dtype, device), _Slots())
        for step in range(self.num_slots):
            i = (slots.next + step) % self.num_slots
            if i == len(slots.tensors):
                slots.tensors.append(self._new_storage(numel, dtype, device))
                slots.holders.append(None)
            if slots.holders[i] is None:
                slots.holders[i] = key
                slots.next = (i + 1) % self.num_slots
                return slots.tensors[i]
        why = (
            f"FixedPoolAllocator: all {self.num_slots} slots of size ({numel}, {dtype}, {device}) "
            f"are in use (held by {slots.holders!r}); free one first or raise num_slots"
        )
        return self.fallback.allocate(key, numel, dtype, device, why)

    def free(self, key: Hashable, tensor: torch.Tensor) -> None:
        if self.fallback.free(tensor):
            return
        slots = self._classes.get((tensor.numel(), tensor.dtype, tensor.device))
        if slots is not None:
            for i, t in enumerate(slots.tensors):
                if t is tensor:
                    if slots.holders[i] is None:
                        raise RuntimeError(f"free({key!r}): slot {i} is already free")
                    slots.holders[i] = None
                    return
        raise RuntimeError(f"free({key!r}): tensor is not a slot of this pool")

    def num_allocated_slots(self) -> int:
        """Slots created so far over all size classes (memory is ``sum`` of their sizes)."""
        return sum(len(s.tensors) for s in self._classes.values())

    def reserved_bytes(self) -> int:
        """Bytes this pool keeps between requests: its slots and persistent fallbacks."""
        slots = sum(t.numel() * t.element_size() for s in self._classes.values() for t in s.tensors)
        return slots + self.fallback.reserved_bytes()
