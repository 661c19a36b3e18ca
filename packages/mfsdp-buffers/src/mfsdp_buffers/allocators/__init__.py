"""Allocators for temporary (unsharded) buffers, all behind the :class:`Allocator` protocol."""

from mfsdp_buffers.allocators.fixed_pool import FixedPoolAllocator, SlotFactory
from mfsdp_buffers.allocators.interval_plan import (
    Interval,
    PoolPlan,
    peak_live_numel,
    plan_offsets,
)
from mfsdp_buffers.allocators.plain import PlainAllocator
from mfsdp_buffers.allocators.protocol import Allocator, has_stable_storage
from mfsdp_buffers.allocators.storage_resize import StorageResizeAllocator
from mfsdp_buffers.allocators.trace_pool import TracePhase, TracePoolAllocator

__all__ = [
    "Allocator",
    "FixedPoolAllocator",
    "Interval",
    "PlainAllocator",
    "PoolPlan",
    "SlotFactory",
    "StorageResizeAllocator",
    "TracePhase",
    "TracePoolAllocator",
    "has_stable_storage",
    "peak_live_numel",
    "plan_offsets",
]
