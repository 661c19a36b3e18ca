"""Which allocator serves the temporary unsharded gradient buffers of one model."""

from __future__ import annotations

from mfsdp_buffers import Allocator, FixedPoolAllocator, PlainAllocator, TracePoolAllocator

GRAD_ALLOCATORS = ("plain", "double_buffer", "trace_pool")


def make_grad_allocator(choice: str | Allocator, max_inflight_reductions: int) -> Allocator:
    """One allocator instance shared by every unit of a model.

    ``double_buffer`` keeps ``max_inflight_reductions + 1`` persistent buffers per size (the
    reductions in flight plus the one being filled), as registered NCCL buffers require;
    ``trace_pool`` replays a static pool planned from the first iteration's requests.
    """
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
    if choice == "double_buffer":
        return FixedPoolAllocator(num_slots=max_inflight_reductions + 1)
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
