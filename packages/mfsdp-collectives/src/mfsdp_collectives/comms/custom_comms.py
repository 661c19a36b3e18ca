"""User-supplied collectives in FSDP2's ``Comm`` protocol (``set_custom_all_gather``,
``set_custom_reduce_scatter``): ``allocate`` says where the buffers come from, ``__call__``
runs the collective. torch's ``AllGather``/``ReduceScatter`` and libraries' comms qualify.
The package README says what each path copies. Two flags of ours, not FSDP2's:

- ``uses_caller_buffers = True``: its ``allocate`` is a plain ``torch.empty``, so the engine
  hands it its own buffers and skips the copies out.
- ``regathers_exactly = False``: gathering again what it delivered rounds again (block
  quantization), so a backward regather of an int ``reshard_after_forward`` carries the
  forward's values exactly instead.

Neither goes over the shared-memory transport or into a coalesced gather.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import Protocol

import torch
import torch.distributed as dist

from ..core._compat import Work
from ..core.naming import group_name
from ..issuing.handle import CommHandle
from ..issuing.stages import issue_stages
from ..tracing.tracer import record_comm

__all__ = [
    "AllGatherComm",
    "Comm",
    "CommAllocator",
    "EmptyBuffers",
    "ReduceScatterComm",
    "allocate_flat",
    "check_comm",
    "custom_all_gather",
    "regathers_exactly",
    "uses_caller_buffers",
]


class Comm(Protocol):
    """FSDP2's ``Comm``: where a collective's buffers come from."""

    def allocate(
        self, size: Sequence[int], *, dtype: torch.dtype, device: torch.device
    ) -> torch.Tensor: ...


class AllGatherComm(Comm, Protocol):
    """FSDP2's ``AllGather``: gathers ``input_tensor`` (this rank's slot of ``output_tensor``)
    from every rank of ``group`` into ``output_tensor``."""

    def __call__(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: dist.ProcessGroup,
        async_op: bool = False,
    ) -> Work | None: ...


class ReduceScatterComm(Comm, Protocol):
    """FSDP2's ``ReduceScatter``: reduces ``input_tensor`` over ``group`` with ``op`` and
    stores this rank's chunk in ``output_tensor``."""

    def __call__(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: dist.ProcessGroup,
        op: dist.ReduceOp.RedOpType,
        async_op: bool = False,
    ) -> Work | None: ...


class EmptyBuffers:
    """FSDP2's default ``allocate``: a fresh ``torch.empty`` buffer per call."""

    def allocate(
        self, size: Sequence[int], *, dtype: torch.dtype, device: torch.device
    ) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)


def uses_caller_buffers(comm: object) -> bool:
    """Whether ``comm`` takes the caller's buffers instead of ones from its ``allocate``."""
    return getattr(comm, "uses_caller_buffers", False) is True


def regathers_exactly(comm: object) -> bool:
    """Whether gathering again what ``comm`` delivered gives the same values."""
    return getattr(comm, "regathers_exactly", True) is not False


def check_comm(comm: object, arg: str) -> None:
    """Raise unless ``comm`` has FSDP2's comm shape: callable, with a callable ``allocate``."""
    if not callable(comm) or not callable(getattr(comm, "allocate", None)):
        raise TypeError(
            f"{arg} must be a comm object in FSDP2's protocol (callable, with "
            "allocate(size, *, dtype, device)), as FSDP2's AllGather and ReduceScatter; "
            f"got {type(comm).__name__}"
        )


def allocate_flat(
    comm: Comm,
    numel: int,
    dtype: torch.dtype,
    device: torch.device,
) -> torch.Tensor:
    """``comm.allocate((numel,), ...)``, checked: a buffer of another size, dtype or device
    would make the collective read or write the wrong bytes, so it raises here."""
    buffer = comm.allocate((numel,), dtype=dtype, device=device)
    if (
        not isinstance(buffer, torch.Tensor)
        or buffer.numel() != numel
        or buffer.dtype != dtype
        or buffer.device != device
        or not buffer.is_contiguous()
    ):
        got = (
            f"shape {tuple(buffer.shape)}, {buffer.dtype} on {buffer.device}"
            if isinstance(buffer, torch.Tensor)
            else type(buffer).__name__
        )
        raise RuntimeError(
            f"{type(comm).__name__}.allocate((({numel},)), dtype={dtype}, device={device}) "
            f"returned {got}; it must return a contiguous tensor of that many elements, "
            "dtype and device"
        )
    return buffer.view(-1)


class CommAllocator:
    """An ``mfsdp_buffers.Allocator`` over a comm's ``allocate``: the buffers a collective
    reads come from where the comm wants them (its pool, registered memory). ``free`` only
    drops our reference; the comm's pool, if any, decides when the bytes are reused."""

    stable_storage = False

    def __init__(self, comm: Comm) -> None:
        self.comm = comm

    def allocate(
        self, key: Hashable, numel: int, dtype: torch.dtype, device: torch.device
    ) -> torch.Tensor:
        return allocate_flat(self.comm, numel, dtype, device)

    def free(self, key: Hashable, tensor: torch.Tensor) -> None:
        del key, tensor


def custom_all_gather(
    shard: torch.Tensor,
    unsharded: torch.Tensor,
    group: dist.ProcessGroup,
    rank: int,
    comm: AllGatherComm,
    *,
    side: torch.Stream | None,
    async_op: bool,
) -> CommHandle:
    """``all_gather_into`` through ``comm`` (arguments checked by the caller): into a buffer
    from ``comm.allocate``, copied into ``unsharded`` once it landed (straight into
    ``unsharded`` where the comm ``uses_caller_buffers``)."""
    n = shard.numel()
    name = group_name(group)
    record_comm("all_gather", name, n, shard.dtype)
    in_place = uses_caller_buffers(comm)
    gathered: list[torch.Tensor] = []

    def issue() -> Work | None:
        buffer = (
            unsharded
            if in_place
            else allocate_flat(comm, unsharded.numel(), shard.dtype, shard.device)
        )
        slot = buffer[rank * n : (rank + 1) * n]
        if slot.data_ptr() != shard.data_ptr():
            slot.copy_(shard)
        gathered.append(buffer)
        return comm(output_tensor=buffer, input_tensor=slot, group=group, async_op=True)

    def finish() -> None:
        buffer = gathered.pop()
        if buffer is not unsharded:
            unsharded.copy_(buffer)

    return issue_stages(
        [(side, issue)],
        device=shard.device,
        finish=finish,
        async_op=async_op,
        keep_alive=(shard, unsharded, gathered),
        reads=(shard,),
        writes=(unsharded,),
        label=f"all_gather on group {name} ({type(comm).__name__})",
    )
