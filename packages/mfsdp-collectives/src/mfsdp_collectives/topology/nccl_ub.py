"""NCCL user buffers: communication buffers from a ``torch.cuda.MemPool`` backed by the
group's NCCL allocator and registered (symmetrically where available), so NCCL can use its
zero-copy, NVLS/SHARP and symmetric-memory algorithms. Elsewhere the option warns once and
does nothing. Registration is collective: every rank must create the pool and enter/leave
``allocation_context()`` in the same order.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

from ..core._compat import backend_name
from .fsdp_topology import default_device

__all__ = ["UserBufferPool", "register_user_buffers"]

_warned: set[str] = set()


def _warn_once(key: str, message: str) -> None:
    if key in _warned:
        return
    _warned.add(key)
    warnings.warn(message, UserWarning, stacklevel=3)


class UserBufferPool:
    """A registered memory pool for one process group (inert off NCCL/CUDA): buffers
    allocated inside ``allocation_context()`` are registered on leaving it."""

    def __init__(
        self,
        group: dist.ProcessGroup,
        *,
        enabled: bool,
        symmetric: bool = True,
        device: torch.device | str | None = None,
    ) -> None:
        if not isinstance(group, dist.ProcessGroup):
            raise TypeError(f"group must be a ProcessGroup, got {type(group).__name__}")
        self.group = group
        self.enabled = bool(enabled)
        self.symmetric = bool(symmetric)
        self.device = torch.device(device) if device is not None else default_device()
        self.pool: Any = None
        self._backend: Any = None
        self._registered = False
        self.symmetric_registered = False
        self.active = False
        if not self.enabled:
            return
        reason = self._unsupported_reason()
        if reason is not None:
            _warn_once(
                reason,
                f"NCCL user buffers (nccl_ub) have no effect here: {reason}; "
                "buffers are allocated normally",
            )
            return
        self._setup_cuda()  # pragma: no cover - needs NCCL on CUDA

    def _unsupported_reason(self) -> str | None:
        backend = backend_name(self.group)
        if backend != "nccl":
            return f"the process group backend is {backend!r}, not 'nccl'"
        if self.device.type != "cuda":
            return f"the device is {self.device.type!r}, not 'cuda'"
        if not hasattr(torch.cuda, "MemPool"):  # pragma: no cover
            return "this torch build has no torch.cuda.MemPool"
        return None

    def _setup_cuda(self) -> None:  # pragma: no cover - needs NCCL on CUDA
        backend = self.group._get_backend(self.device)
        try:
            allocator = getattr(backend, "mem_allocator", None)
            if allocator is None and hasattr(backend, "_get_mem_allocator"):
                allocator = backend._get_mem_allocator()
            missing = "this torch's ProcessGroupNCCL exposes no mem_allocator"
        except RuntimeError as exc:
            # torch built against an NCCL without ncclMemAlloc raises from the property
            # (seen with torch 2.11+cu130 on an H200): the feature is absent, not broken.
            allocator, missing = None, str(exc)
        if allocator is None:
            _warn_once(
                "no-nccl-allocator",
                f"NCCL user buffers (nccl_ub) have no effect: {missing}; "
                "buffers are allocated normally",
            )
            return
        self._backend = backend
        self.pool = torch.cuda.MemPool(allocator)
        self.active = True

    @contextlib.contextmanager
    def _pool_context(self) -> Iterator[None]:  # pragma: no cover - needs NCCL on CUDA
        if self._registered:
            # Segments allocated now would be missed by the old registration:
            # deregister, allocate, register the whole pool again on exit.
            self._backend.deregister_mem_pool(self.pool)
            self._registered = False
        try:
            with torch.cuda.use_mem_pool(self.pool):
                yield
        finally:
            self.register()

    def allocation_context(self) -> contextlib.AbstractContextManager[None]:
        """Context in which tensor allocations come from the registered pool."""
        if not self.active:
            return contextlib.nullcontext()
        return self._pool_context()  # pragma: no cover - needs NCCL on CUDA

    def register(self) -> None:
        """(Re-)register the pool with the communicator; a no-op when inactive."""
        if not self.active or self._registered:
            return
        if self.symmetric:  # pragma: no cover - needs NCCL on CUDA
            try:
                self._backend.register_mem_pool(self.pool, symm=True)
                self._registered = self.symmetric_registered = True
                return
            except (TypeError, RuntimeError) as exc:
                _warn_once(
                    "no-symmetric",
                    f"symmetric NCCL registration unavailable ({exc}); using plain registration",
                )
        self._backend.register_mem_pool(self.pool)  # pragma: no cover
        self._registered = True  # pragma: no cover

    def deregister(self) -> None:
        """Release the registration (call before destroying the process group)."""
        if self.active and self._registered:  # pragma: no cover - needs NCCL on CUDA
            self._backend.deregister_mem_pool(self.pool)
            self._registered = self.symmetric_registered = False

    def __repr__(self) -> str:
        return (
            f"UserBufferPool(enabled={self.enabled}, active={self.active}, "
            f"symmetric={self.symmetric}, registered={self._registered})"
        )


def register_user_buffers(
    group: dist.ProcessGroup,
    *,
    enabled: bool = True,
    symmetric: bool = True,
    device: torch.device | str | None = None,
) -> UserBufferPool:
    """Create the user-buffer pool for ``group`` (``symmetric=False`` is the
    ``disable_symmetric_registration`` switch)."""
    return UserBufferPool(group, enabled=enabled, symmetric=symmetric, device=device)
