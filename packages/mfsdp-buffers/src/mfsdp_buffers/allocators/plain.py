"""``torch.empty`` per request: the baseline every other allocator is measured against."""

from __future__ import annotations

from collections.abc import Hashable
from typing import ClassVar

import torch

from mfsdp_buffers.allocators.protocol import check_request


class PlainAllocator:
    """Allocates with ``torch.empty``; ``free`` just drops the reference.

    Memory returns to the framework's caching allocator once the caller's last
    reference dies. Simple and always correct, but each gather gets a new tensor,
    so views taken earlier (parameters, autograd-saved tensors) must be refreshed.
    """

    stable_storage: ClassVar[bool] = False

    def allocate(
        self, key: Hashable, numel: int, dtype: torch.dtype, device: torch.device
    ) -> torch.Tensor:
        check_request(numel, dtype, device)
        return torch.empty(numel, dtype=dtype, device=device)

    def free(self, key: Hashable, tensor: torch.Tensor) -> None:
        """Nothing to do: the caller drops its reference and the memory follows."""
