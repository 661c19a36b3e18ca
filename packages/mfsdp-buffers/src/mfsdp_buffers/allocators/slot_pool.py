"""What the persistent slot pools share: their slot count, how a slot's storage is made and
checked, and the fallback store for requests no slot can serve."""

from __future__ import annotations

from collections.abc import Callable
from typing import Generic, TypeVar

import torch

from mfsdp_buffers.allocators.fallback import FallbackStore, OnFull

SlotFactory = Callable[[int, torch.dtype, torch.device], torch.Tensor]
"""Creates one slot's storage: ``(numel, dtype, device) -> 1-D tensor``."""


ClassKey = TypeVar("ClassKey")
Slots = TypeVar("Slots")


def _empty(numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return torch.empty(numel, dtype=dtype, device=device)


class SlotPoolBase(Generic[ClassKey, Slots]):
    """``num_slots`` persistent slots made by ``factory``, kept per request class (``Slots``
    records per ``ClassKey``: the subclass says what a class is); ``on_full`` for the rest."""

    def __init__(
        self,
        num_slots: int = 2,
        *,
        factory: SlotFactory | None = None,
        on_full: OnFull = "raise",
    ) -> None:
        if isinstance(num_slots, bool) or not isinstance(num_slots, int) or num_slots < 1:
            raise ValueError(f"num_slots must be an int >= 1, got {num_slots!r}")
        self.num_slots = num_slots
        self._factory: SlotFactory = factory if factory is not None else _empty
        self.fallback = FallbackStore(on_full, self._new_storage)
        self._classes: dict[ClassKey, Slots] = {}

    def _new_storage(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        tensor = self._factory(numel, dtype, device)
        if tensor.dim() != 1 or tensor.numel() != numel or tensor.dtype != dtype:
            raise RuntimeError(
                f"slot factory returned shape {tuple(tensor.shape)} dtype {tensor.dtype}; "
                f"expected ({numel},) {dtype}"
            )
        return tensor
