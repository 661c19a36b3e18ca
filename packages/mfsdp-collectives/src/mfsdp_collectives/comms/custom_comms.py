"""User-supplied collectives, in FSDP2's ``Comm`` protocol (``set_custom_all_gather``,
``set_custom_reduce_scatter``).

A custom comm owns two things about one collective: where its buffers come from
(``allocate(size, *, dtype, device)``) and how it runs (``__call__``). torch's
``torch.distributed.fsdp.AllGather``/``ReduceScatter`` subclasses are such objects, so are
libraries' (torchft, low-precision reduce-scatters); this layer needs only their shape.

How ours uses them, and what it costs against the built-in path:

- all-gather: the output buffer comes from ``comm.allocate``; this rank's shard is copied into
  its slot (the input is that slot, as FSDP2's), the comm runs, and the gathered buffer is
  copied into the caller's unsharded buffer once it landed (FSDP2 copies out too; our
  built-in gather writes straight into the parameters' storage instead).
- reduce-scatter: the caller allocates the input (the engine's unsharded gradient buffer, from
  a ``CommAllocator`` over the comm) and the output comes from ``comm.allocate``; the result is
  scaled and stored into the caller's shard once it landed.

A comm that sets ``uses_caller_buffers = True`` declares that its ``allocate`` is nothing
but a fresh ``torch.empty``: any contiguous buffer of the size, dtype and device serves. The
engine then hands it its own buffers (the unsharded buffer of a gather, the output shard of a
reduce-scatter that stores, the pooled gradient buffer it reads) and skips the copies out.
Ours (``QuantizedAllGather``, ``QuantizedReduceScatter``) do; FSDP2's protocol has no such
flag, so any other comm keeps FSDP2's buffers and copies.

A comm that sets ``regathers_exactly = False`` declares that gathering again what it
delivered would not give the same values (a lossy code that rounds again on every pass, as
block quantization does). Where the engine regathers values a gather already delivered
(the backward gather of an int ``reshard_after_forward``, from the slices kept after
forward) it then carries them exactly instead, so backward computes with the forward's
weights. Any other comm runs that gather too, as FSDP2 runs it.

Neither goes over the shared-memory transport or into a coalesced gather: the comm decides
how the bytes travel.
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
    """Whether ``comm`` takes the caller's buffers (``uses_caller_buffers = True``, see the
    module docstring) instead of ones from its ``allocate``."""
    return getattr(comm, "uses_caller_buffers", False) is True


def regathers_exactly(comm: object) -> bool:
    """Whether gathering again what ``comm`` delivered gives the same values (see the module
    docstring): True unless it sets ``regathers_exactly = False``."""
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
