"""Persistent double (or N-) buffering: a fixed set of slots per size class, reused round-robin."""

from __future__ import annotations

from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import ClassVar

import torch

from mfsdp_buffers.allocators.protocol import check_request

SlotFactory = Callable[[int, torch.dtype, torch.device], torch.Tensor]
"""Creates one slot's storage: ``(numel, dtype, device) -> 1-D tensor``."""

_SizeClass = tuple[int, torch.dtype, torch.device]


def _empty(numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return torch.empty(numel, dtype=dtype, device=device)


@dataclass
class _Slots:
    tensors: list[torch.Tensor] = field(default_factory=list)
    holders: list[Hashable | None] = field(default_factory=list)
    next: int = 0


class FixedPoolAllocator:
    """``num_slots`` persistent tensors per ``(numel, dtype, device)``, handed out round-robin.

    The memory is allocated once and never returned, which is what registered
    communication buffers (NCCL user buffers, symmetric memory) need: the
    registration is done once on the slot's storage, through ``factory``
    (e.g. allocate inside a registered memory pool). Running out of slots is a
    scheduling bug upstream (too many gathers in flight), so it raises instead
    of silently allocating unregistered memory.
    """

    stable_storage: ClassVar[bool] = False

    def __init__(self, num_slots: int = 2, *, factory: SlotFactory | None = None) -> None:
        if isinstance(num_slots, bool) or not isinstance(num_slots, int) or num_slots < 1:
            raise ValueError(f"num_slots must be an int >= 1, got {num_slots!r}")
        self.num_slots = num_slots
        self._factory: SlotFactory = factory if factory is not None else _empty
        self._classes: dict[_SizeClass, _Slots] = {}

    def allocate(
        self, key: Hashable, numel: int, dtype: torch.dtype, device: torch.device
    ) -> torch.Tensor:
        check_request(numel, dtype, device)
        slots = self._classes.setdefault((numel, dtype, device), _Slots())
        for step in range(self.num_slots):
            i = (slots.next + step) % self.num_slots
            if i == len(slots.tensors):
                slots.tensors.append(self._new_slot(numel, dtype, device))
                slots.holders.append(None)
            if slots.holders[i] is None:
                slots.holders[i] = key
                slots.next = (i + 1) % self.num_slots
                return slots.tensors[i]
        raise RuntimeError(
            f"FixedPoolAllocator: all {self.num_slots} slots of size ({numel}, {dtype}, {device}) "
            f"are in use (held by {slots.holders!r}); free one first or raise num_slots"
        )

    def free(self, key: Hashable, tensor: torch.Tensor) -> None:
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

    def _new_slot(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        tensor = self._factory(numel, dtype, device)
        if tensor.dim() != 1 or tensor.numel() != numel or tensor.dtype != dtype:
            raise RuntimeError(
                f"slot factory returned shape {tuple(tensor.shape)} dtype {tensor.dtype}; "
                f"expected ({numel},) {dtype}"
            )
        return tensor
