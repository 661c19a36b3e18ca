"""What a pool of persistent slots hands out when none of its slots can serve a request:
``on_full`` of ``"raise"`` (a scheduling bug upstream), ``"dynamic"`` (a fresh tensor, not
registrable) or ``"persistent"`` (one kept per requester key and size: the reference's
``fsdp_db_use_persist_buf_on_alloc_fail``). See the package README, "Allocators".
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import Literal

import torch

OnFull = Literal["raise", "dynamic", "persistent"]
ON_FULL: tuple[OnFull, ...] = ("raise", "dynamic", "persistent")

_PersistentKey = tuple[Hashable, int, torch.dtype, torch.device]


class FallbackStore:
    """The tensors a pool lent outside its slots, and the persistent ones it keeps."""

    def __init__(
        self,
        on_full: OnFull,
        factory: Callable[[int, torch.dtype, torch.device], torch.Tensor],
    ) -> None:
        if on_full not in ON_FULL:
            raise ValueError(f"on_full must be one of {ON_FULL}, got {on_full!r}")
        self.on_full = on_full
        self._factory = factory
        self._persistent: dict[_PersistentKey, torch.Tensor] = {}
        self._lent: dict[int, Hashable] = {}  # id(tensor) -> key, while lent out
        self.requests_served = 0
        """How many requests the slots could not serve (each served here)."""

    def allocate(
        self, key: Hashable, numel: int, dtype: torch.dtype, device: torch.device, why: str
    ) -> torch.Tensor:
        if self.on_full == "raise":
            raise RuntimeError(why)
        if self.on_full == "persistent":
            found = self._persistent.get((key, numel, dtype, device))
            if found is None:
                found = self._factory(numel, dtype, device)
                self._persistent[(key, numel, dtype, device)] = found
            tensor = found
        else:
            tensor = torch.empty(numel, dtype=dtype, device=device)
        if id(tensor) in self._lent:
            raise RuntimeError(f"allocate({key!r}): its persistent buffer is still in use")
        self._lent[id(tensor)] = key
        self.requests_served += 1
        return tensor

    def free(self, tensor: torch.Tensor) -> bool:
        """Take ``tensor`` back if this store lent it; False if it is not one of ours."""
        return self._lent.pop(id(tensor), None) is not None

    def reserved_bytes(self) -> int:
        """Bytes kept between requests (the persistent tensors)."""
        return sum(t.numel() * t.element_size() for t in self._persistent.values())
