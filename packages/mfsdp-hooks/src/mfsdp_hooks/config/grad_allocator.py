"""Which allocator serves the temporary unsharded gradient buffers of one model."""

from __future__ import annotations

from dataclasses import dataclass

from mfsdp_buffers import (
    ON_FULL,
    Allocator,
    FixedPoolAllocator,
    MaxPoolAllocator,
    OnFull,
    PlainAllocator,
    TracePoolAllocator,
)

GRAD_ALLOCATORS = ("plain", "double_buffer", "trace_pool")


@dataclass(frozen=True)
class DoubleBuffer:
    """Persistent reduce buffers: ``max_inflight_reductions + 1`` slots (the reductions in
    flight plus the one being filled), as registered NCCL buffers require.

    ``max_pool`` (the reference's ``megatron_fsdp_max_pool_double_buffer``): the slots are
    per dtype, each as large as the largest unit's buffer, instead of per exact size (memory:
    slots x the largest unit, instead of slots x every distinct unit size). ``on_full``: what
    a request no slot can serve gets: ``"raise"``, ``"dynamic"`` (a fresh allocation, the
    reference's default) or ``"persistent"`` (a buffer kept for that unit, the reference's
    ``fsdp_db_use_persist_buf_on_alloc_fail``).
    """

    max_pool: bool = False
    on_full: OnFull = "raise"

    def __post_init__(self) -> None:
        if self.on_full not in ON_FULL:
            raise ValueError(f"DoubleBuffer.on_full must be one of {ON_FULL}, got {self.on_full!r}")

    def allocator(self, num_slots: int) -> Allocator:
        if self.max_pool:
            return MaxPoolAllocator(num_slots, on_full=self.on_full)
        return FixedPoolAllocator(num_slots, on_full=self.on_full)


def make_grad_allocator(
    choice: str | DoubleBuffer | Allocator, max_inflight_reductions: int
) -> Allocator:
    """One allocator instance shared by every unit of a model.

    ``double_buffer`` is ``DoubleBuffer()`` (see there); ``trace_pool`` replays a static pool
    planned from the first iteration's requests.
    """
    if choice == "double_buffer":
        choice = DoubleBuffer()
    if isinstance(choice, DoubleBuffer):
        return choice.allocator(max_inflight_reductions + 1)
    if not isinstance(choice, str):
        for method in ("allocate", "free"):
            if not callable(getattr(choice, method, None)):
                raise TypeError(
                    f"grad_buffer_allocator must be one of {GRAD_ALLOCATORS} or an object with "
                    f"allocate() and free(); {type(choice).__name__} has no {method}()"
                )
        return choice
    if choice == "plain":
        return PlainAllocator()
    if choice == "trace_pool":
        return TracePoolAllocator()
    raise ValueError(
        f"grad_buffer_allocator={choice!r} is not an allocator: use one of {GRAD_ALLOCATORS}"
    )


def pools_memory(allocator: object | None) -> bool:
    """Whether ``allocator`` keeps memory across frees (a pool, or a user's allocator).

    Such an allocator exists to serve flat reduce buffers, so units keep using them, and
    its frees stay in a fixed order (the trace pool plans from the first iteration's).
    """
    return allocator is not None and type(allocator) is not PlainAllocator


def end_iteration(allocator: object) -> None:
    """Tell iteration-aware allocators (the trace pool) that one training iteration ended."""
    hook = getattr(allocator, "end_iteration", None)
    if callable(hook):
        hook()
