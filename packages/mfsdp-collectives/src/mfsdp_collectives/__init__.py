"""mfsdp_collectives: layer 2 of megatron-fsdp, the communication layer (the package README
is its walk-through): topology, async collectives on flat buffers, accounting and the
multi-rank test harness (``mfsdp_collectives.testing``)."""

from __future__ import annotations

from .comms.block_codec import CODED_DTYPES, BlockQuantization
from .comms.custom_comms import (
    AllGatherComm,
    CommAllocator,
    ReduceScatterComm,
    check_comm,
    regathers_exactly,
    uses_caller_buffers,
)
from .comms.exact_values import ExactPositions
from .comms.quantization_buffers import QuantizationBuffers
from .comms.quantization_errors import ErrorSums, QuantizationErrorLog
from .comms.quantized import (
    NonFiniteError,
    quantized_all_gather_into,
    quantized_reduce_scatter_into,
)
from .comms.quantized_comms import QuantizedAllGather, QuantizedReduceScatter
from .core.fake import RealMeshesFakeMode, is_fake, real_tensors
from .core.naming import group_name, register_group_name
from .host.collective_worker import BackgroundWork, CollectiveWorker
from .host.host_transport import (
    HOST_TRANSPORTS,
    check_host_transport,
    disable_host_transport,
    enable_host_transport,
    host_transport_of,
)
from .host.shm import SharedMemoryTransport
from .issuing._reduce import ReduceSpec
from .issuing.handle import CommHandle
from .issuing.streams import CommStreams
from .issuing.strict import strict_async, strict_async_enabled
from .ops.coalescing import coalesced_gathers
from .ops.exchange import all_to_all_into
from .ops.flat_ops import (
    all_gather_into,
    all_reduce_,
    broadcast_,
    reduce_scatter_into,
)
from .ops.hsdp_ops import hfsdp_reduce_scatter_into, hsdp_reduce_scatter_into
from .ops.route import Route
from .safety.agreement import RankMismatchError, check_ranks_agree
from .safety.liveness import (
    PeerDiedError,
    call_watching_peers,
    dead_ranks,
    exchange_identities,
    naming_dead_peers,
)
from .topology.fsdp_topology import FSDPTopology, default_device, mesh_has_dim
from .topology.nccl_ub import UserBufferPool, register_user_buffers
from .topology.optim_sharding import OptimizerSharding
from .topology.post_forward import PostForwardGroup, check_post_forward_size, post_forward_group
from .tracing.c10d_tracer import C10dTracer
from .tracing.tracer import CommLog, CommRecord, CommTracer

__version__ = "1.0.0"

__all__ = [
    "CODED_DTYPES",
    "BlockQuantization",
    "NonFiniteError",
    "QuantizedAllGather",
    "QuantizedReduceScatter",
    "QuantizationBuffers",
    "ExactPositions",
    "QuantizationErrorLog",
    "ErrorSums",
    "BackgroundWork",
    "CollectiveWorker",
    "quantized_all_gather_into",
    "quantized_reduce_scatter_into",
    "AllGatherComm",
    "CommAllocator",
    "ReduceScatterComm",
    "check_comm",
    "regathers_exactly",
    "uses_caller_buffers",
    "mesh_has_dim",
    "CommHandle",
    "C10dTracer",
    "CommLog",
    "CommRecord",
    "CommStreams",
    "CommTracer",
    "FSDPTopology",
    "HOST_TRANSPORTS",
    "OptimizerSharding",
    "PeerDiedError",
    "PostForwardGroup",
    "RankMismatchError",
    "ReduceSpec",
    "Route",
    "SharedMemoryTransport",
    "UserBufferPool",
    "__version__",
    "all_gather_into",
    "all_to_all_into",
    "all_reduce_",
    "broadcast_",
    "check_host_transport",
    "check_post_forward_size",
    "check_ranks_agree",
    "coalesced_gathers",
    "call_watching_peers",
    "dead_ranks",
    "default_device",
    "disable_host_transport",
    "enable_host_transport",
    "exchange_identities",
    "group_name",
    "is_fake",
    "real_tensors",
    "RealMeshesFakeMode",
    "hfsdp_reduce_scatter_into",
    "host_transport_of",
    "hsdp_reduce_scatter_into",
    "naming_dead_peers",
    "post_forward_group",
    "reduce_scatter_into",
    "strict_async",
    "strict_async_enabled",
    "register_group_name",
    "register_user_buffers",
]
