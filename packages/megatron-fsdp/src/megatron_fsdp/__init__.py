"""megatron-fsdp: Fully Sharded Data Parallel for PyTorch, on any torch.distributed backend."""

from megatron_fsdp.api import fully_shard, fully_shard_model, fully_shard_optimizer
from megatron_fsdp.ddp_config import DistributedDataParallelConfig
from megatron_fsdp.dist_index import FSDPDistributedIndex
from megatron_fsdp.plan import MemoryPlan, plan_memory
from megatron_fsdp.trace import OverlapReport, Timeline, trace
from megatron_fsdp.wrapper import MegatronFSDP
from mfsdp_collectives import BlockQuantization, QuantizationErrorLog
from mfsdp_hooks import (
    MixedPrecisionPolicy,
    Muon,
    ShardingStrategy,
    declare_elementwise_optimizer,
    declare_shard_aware_optimizer,
    quantize_communication,
)

__version__ = "1.0.0"

__all__ = [
    "BlockQuantization",
    "QuantizationErrorLog",
    "DistributedDataParallelConfig",
    "FSDPDistributedIndex",
    "MegatronFSDP",
    "MixedPrecisionPolicy",
    "Muon",
    "MemoryPlan",
    "ShardingStrategy",
    "__version__",
    "declare_elementwise_optimizer",
    "declare_shard_aware_optimizer",
    "fully_shard",
    "fully_shard_model",
    "fully_shard_optimizer",
    "plan_memory",
    "quantize_communication",
    "OverlapReport",
    "Timeline",
    "trace",
]
