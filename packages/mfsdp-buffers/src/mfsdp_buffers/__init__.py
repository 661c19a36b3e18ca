"""mfsdp_buffers: layer 1 of megatron-fsdp, the memory side with no process groups (README)."""

from mfsdp_buffers.allocators import (
    ON_FULL,
    Allocator,
    FixedPoolAllocator,
    Interval,
    MaxPoolAllocator,
    OnFull,
    PlainAllocator,
    PoolPlan,
    SlotFactory,
    StorageResizeAllocator,
    TracePhase,
    TracePoolAllocator,
    allocate_checked,
    has_stable_storage,
    peak_live_numel,
    plan_offsets,
)
from mfsdp_buffers.bucketing import Bucket, BucketKey, build_buckets
from mfsdp_buffers.buffer import BufferRole, DataParallelBuffer
from mfsdp_buffers.flat_pieces import FlatPieces
from mfsdp_buffers.layout import FlatLayout, LocalPiece, ParamPlacement
from mfsdp_buffers.live_memory import LiveTensorTracker, PhaseMark
from mfsdp_buffers.poison import (
    is_poisoned,
    poison_,
    poisoning_enabled,
    poisoning_released_buffers,
    release_to,
)
from mfsdp_buffers.residence import host_side, mark_host, on_host

__version__ = "1.0.0"

__all__ = [
    "ON_FULL",
    "Allocator",
    "Bucket",
    "BucketKey",
    "BufferRole",
    "DataParallelBuffer",
    "FixedPoolAllocator",
    "FlatLayout",
    "FlatPieces",
    "Interval",
    "LiveTensorTracker",
    "LocalPiece",
    "MaxPoolAllocator",
    "OnFull",
    "ParamPlacement",
    "PhaseMark",
    "PlainAllocator",
    "PoolPlan",
    "SlotFactory",
    "StorageResizeAllocator",
    "TracePhase",
    "TracePoolAllocator",
    "__version__",
    "allocate_checked",
    "build_buckets",
    "has_stable_storage",
    "host_side",
    "is_poisoned",
    "mark_host",
    "on_host",
    "peak_live_numel",
    "plan_offsets",
    "poison_",
    "poisoning_enabled",
    "poisoning_released_buffers",
    "release_to",
]
