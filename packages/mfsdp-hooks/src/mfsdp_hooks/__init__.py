"""mfsdp_hooks: the FSDP unit lifecycle, mixed precision and optimizer integration."""

from mfsdp_hooks.fully_shard import FSDPModule, fsdp_units, fully_shard, is_fully_sharded
from mfsdp_hooks.megatron_fsdp import MegatronFSDP, resolve_unit_modules
from mfsdp_hooks.mixed_precision import MixedPrecisionPolicy
from mfsdp_hooks.optimizer import attach_optimizer, optimizer_groups
from mfsdp_hooks.param_group import ParameterGroup
from mfsdp_hooks.reduce_config import GradReduceConfig
from mfsdp_hooks.strategy import ShardingStrategy, parse_strategy
from mfsdp_hooks.training_state import TrainingState

__version__ = "0.1.0"

__all__ = [
    "FSDPModule",
    "GradReduceConfig",
    "MegatronFSDP",
    "MixedPrecisionPolicy",
    "ParameterGroup",
    "ShardingStrategy",
    "TrainingState",
    "__version__",
    "attach_optimizer",
    "fsdp_units",
    "fully_shard",
    "is_fully_sharded",
    "optimizer_groups",
    "parse_strategy",
    "resolve_unit_modules",
]
