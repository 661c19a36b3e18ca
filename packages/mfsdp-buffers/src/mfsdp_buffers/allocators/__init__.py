"""Allocators for temporary (unsharded) buffers, all behind the :class:`Allocator` protocol."""

from mfsdp_buffers.allocators.fallback import ON_FULL, FallbackStore, OnFull
from mfsdp_buffers.allocators.fixed_pool import FixedPoolAllocator
from mfsdp_buffers.allocators.interval_plan import (
    Interval,
    PoolPlan,
    peak_live_numel,
    plan_offsets,
)
from mfsdp_buffers.allocators.max_pool import MaxPoolAllocator
from mfsdp_buffers.allocators.plain import PlainAllocator
from mfsdp_buffers.allocators.protocol import Allocator, allocate_checked, has_stable_storage
from mfsdp_buffers.allocators.slot_pool import SlotFactory
from mfsdp_buffers.allocators.storage_resize import StorageResizeAllocator
from mfsdp_buffers.allocators.trace_pool import TracePhase, TracePoolAllocator

__all__ = [
    "ON_FULL",
    "Allocator",
    "FallbackStore",
    "FixedPoolAllocator",
    "MaxPoolAllocator",
    "OnFull",
    "Interval",
    "PlainAllocator",
    "PoolPlan",
    "SlotFactory",
    "StorageResizeAllocator",
    "TracePhase",
    "TracePoolAllocator",
    "allocate_checked",
    "has_stable_storage",
    "peak_live_numel",
    "plan_offsets",
]
