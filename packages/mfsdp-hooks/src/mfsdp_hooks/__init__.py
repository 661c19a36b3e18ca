"""mfsdp_hooks: the FSDP unit lifecycle, mixed precision and optimizer integration."""

from typing import TYPE_CHECKING

from mfsdp_hooks.api.comm_quantization import quantize_communication
from mfsdp_hooks.api.describe import (
    MODEL_STATE_CATEGORIES,
    GroupSummary,
    ShardingSummary,
    describe,
    heaviest_rank,
)
from mfsdp_hooks.api.forward_methods import register_fsdp_forward_method
from mfsdp_hooks.api.fully_shard import (
    FSDPModule,
    UnshardHandle,
    fsdp_units,
    fully_shard,
    is_fully_sharded,
)
from mfsdp_hooks.api.mesh_topology import resolve_topology
from mfsdp_hooks.api.root_wrapper import (
    FSDPRootWrapper,
    UnitSpec,
    fine_grained_units,
    resolve_unit_modules,
)
from mfsdp_hooks.config.codec import (
    CodecContext,
    GroupCodec,
    IdentityCodec,
    ParamClassCodec,
    ParamCodec,
)
from mfsdp_hooks.config.experts import ExpertSharding, is_megatron_expert
from mfsdp_hooks.config.grad_allocator import GRAD_ALLOCATORS, DoubleBuffer, make_grad_allocator
from mfsdp_hooks.config.mixed_precision import MixedPrecisionPolicy
from mfsdp_hooks.config.offload import forced_host_copies
from mfsdp_hooks.config.reduce_config import GradReduceConfig
from mfsdp_hooks.config.sharding_options import ShardingOptions
from mfsdp_hooks.config.strategy import (
    ShardingStrategy,
    check_post_forward_strategy,
    parse_strategy,
)
from mfsdp_hooks.config.unit_options import UnitOptions
from mfsdp_hooks.dtensor.dcp_protocol import row_write_items
from mfsdp_hooks.dtensor.dtensor_views import dtensor_like, local_tensor
from mfsdp_hooks.dtensor.load_rows import own_rows
from mfsdp_hooks.dtensor.row_sharded import RowShardedDTensor, row_sharded
from mfsdp_hooks.dtensor.tensor_parallel import TPSpec, tp_full_tensor
from mfsdp_hooks.optim.contiguous_step import ACCELERATOR_CHUNK_NUMEL
from mfsdp_hooks.optim.muon import Muon, newton_schulz, newton_schulz_cost
from mfsdp_hooks.optim.optimizer import FSDPOptimizer, attach_optimizer, optimizer_groups
from mfsdp_hooks.optim.whole_matrix import MatrixRows, map_whole_matrices, plan_owners, rows_of
from mfsdp_hooks.runtime.elementwise_optimizers import (
    declare_elementwise_optimizer,
    declare_shard_aware_optimizer,
    is_elementwise_optimizer,
    steps_shards_exactly,
)
from mfsdp_hooks.runtime.observe import format_bytes
from mfsdp_hooks.runtime.timeline import TimelineRecorder, record_timeline
from mfsdp_hooks.runtime.timeline_chrome import chrome_trace
from mfsdp_hooks.runtime.timeline_events import (
    HOST_CATEGORIES,
    EventKind,
    TimelineEvent,
    TimelineStep,
)
from mfsdp_hooks.runtime.timeline_report import OverlapReport, UnitTimes, build_overlap_report
from mfsdp_hooks.runtime.training_state import TrainingState
from mfsdp_hooks.runtime.unit import FSDPUnit
from mfsdp_hooks.weights.lookup import (
    ParamLocation,
    dist_param_of,
    locate,
    optimizer_grad,
    owning_model,
)
from mfsdp_hooks.weights.param_group import DEFAULT_ALIGNMENT, ParameterGroup

__version__ = "1.0.0"

__all__ = [
    "ACCELERATOR_CHUNK_NUMEL",
    "Muon",
    "DEFAULT_ALIGNMENT",
    "GroupSummary",
    "ShardingSummary",
    "describe",
    "heaviest_rank",
    "MODEL_STATE_CATEGORIES",
    "forced_host_copies",
    "format_bytes",
    "CodecContext",
    "ExpertSharding",
    "GroupCodec",
    "ParamClassCodec",
    "RowShardedDTensor",
    "row_sharded",
    "row_write_items",
    "own_rows",
    "is_megatron_expert",
    "TPSpec",
    "tp_full_tensor",
    "GRAD_ALLOCATORS",
    "DoubleBuffer",
    "FSDPModule",
    "FSDPUnit",
    "GradReduceConfig",
    "MixedPrecisionPolicy",
    "ParamLocation",
    "ParamCodec",
    "ParameterGroup",
    "ShardingStrategy",
    "TrainingState",
    "UnitSpec",
    "UnitOptions",
    "UnshardHandle",
    "__version__",
    "FSDPOptimizer",
    "IdentityCodec",
    "attach_optimizer",
    "declare_elementwise_optimizer",
    "declare_shard_aware_optimizer",
    "is_elementwise_optimizer",
    "map_whole_matrices",
    "MatrixRows",
    "newton_schulz",
    "newton_schulz_cost",
    "plan_owners",
    "rows_of",
    "steps_shards_exactly",
    "dist_param_of",
    "dtensor_like",
    "fsdp_units",
    "fully_shard",
    "is_fully_sharded",
    "local_tensor",
    "locate",
    "quantize_communication",
    "fine_grained_units",
    "make_grad_allocator",
    "register_fsdp_forward_method",
    "optimizer_groups",
    "optimizer_grad",
    "owning_model",
    "parse_strategy",
    "check_post_forward_strategy",
    "resolve_topology",
    "resolve_unit_modules",
    "EventKind",
    "HOST_CATEGORIES",
    "TimelineEvent",
    "TimelineRecorder",
    "TimelineStep",
    "record_timeline",
    "OverlapReport",
    "UnitTimes",
    "build_overlap_report",
    "chrome_trace",
    "FSDPRootWrapper",
    "ShardingOptions",
    "PipelineStage",
    "sharded_roots",
]

# Pipeline stages: torch.distributed.pipelining takes about a second to import, and every
# spawned rank imports this package, so they load on first use.
if TYPE_CHECKING:
    from mfsdp_hooks.api.pipelining import PipelineStage, sharded_roots
else:

    def __getattr__(name: str) -> object:
        if name in ("PipelineStage", "sharded_roots"):
            from mfsdp_hooks.api import pipelining

            return getattr(pipelining, name)
        raise AttributeError(f"module 'mfsdp_hooks' has no attribute {name!r}")
