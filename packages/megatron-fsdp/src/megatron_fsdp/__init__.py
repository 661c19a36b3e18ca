"""megatron-fsdp: Fully Sharded Data Parallel for PyTorch, on any torch.distributed backend."""

from megatron_fsdp.api import fully_shard, fully_shard_model, fully_shard_optimizer
from mfsdp_hooks import MegatronFSDP, MixedPrecisionPolicy, ShardingStrategy

__version__ = "0.1.0"

__all__ = [
    "MegatronFSDP",
    "MixedPrecisionPolicy",
    "ShardingStrategy",
    "__version__",
    "fully_shard",
    "fully_shard_model",
    "fully_shard_optimizer",
]
