"""``ShardingOptions``: how a whole model is sharded, as one frozen, typed record under the
seed's names, from the meta-package's public functions to the root wrapper, which reads each
field into an explicit argument of ``fully_shard`` (see the package README's root wrapper).

The meta-package resolves what needs the reference's other arguments before it builds the
record: ``device_mesh`` with ``dp_shard_dim``/``dp_outer_dim``/``tp_dim``/
``hybrid_fsdp_group`` becomes one ``FSDPTopology``, ``expt_device_mesh`` an
``ExpertSharding``, ``grad_reduce_in_fp32``/``preserve_fp32_weights`` a policy and
``fsdp_double_buffer`` a gradient-buffer allocator. Building a record communicates nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import OffloadPolicy

from mfsdp_buffers import Allocator
from mfsdp_collectives import FSDPTopology
from mfsdp_hooks.config.codec import ParamClassCodec, ParamCodec
from mfsdp_hooks.config.experts import ExpertSharding
from mfsdp_hooks.config.grad_allocator import DoubleBuffer
from mfsdp_hooks.config.mixed_precision import MixedPrecisionPolicy, from_fsdp2_policy
from mfsdp_hooks.config.strategy import ShardingStrategy, parse_strategy

__all__ = ["ShardingOptions"]


@dataclass(frozen=True, kw_only=True)
class ShardingOptions:
    """Every unit's choices for one model; the defaults are ``fully_shard_model``'s."""

    zero_dp_strategy: ShardingStrategy = ShardingStrategy.OPTIM_GRADS_PARAMS
    """What is sharded over the shard group (``parse_strategy`` also takes 0-3 or a name)."""
    device_mesh: DeviceMesh | FSDPTopology | None = None
    """None: a 1-D mesh over the default group; a 1-D mesh, a 2-D (dp_outer, dp_shard) mesh
    (HSDP), or the topology the meta-package resolved from the seed's mesh arguments."""
    mixed_precision_policy: MixedPrecisionPolicy | None = None
    """None: the default policy (fp32 main weights). torch FSDP2's policy is converted."""
    init_model_with_meta_device: bool = False
    overlap_grad_reduce: bool = True
    overlap_param_gather: bool = True
    sync_model_each_microbatch: bool = True
    average_in_collective: bool = True
    gradient_scaling_factor: float | None = None
    calculate_per_token_loss: bool = False
    report_nan_in_param_grad: bool = False
    host_transport: str = "auto"
    backward_prefetch_grad_fraction: float = 0.5
    grad_buffer_allocator: str | DoubleBuffer | Allocator = "plain"
    """``"plain"``, ``"double_buffer"`` (the seed's ``fsdp_double_buffer``; a
    ``DoubleBuffer`` says which kind), ``"trace_pool"`` or an allocator; one instance serves
    every unit of the model."""
    experts: ExpertSharding | None = None
    """Expert parallelism (the seed's ``expt_device_mesh``, resolved)."""
    param_codecs: tuple[ParamClassCodec, ...] = ()
    """Codecs that claim tensor-subclass parameters (FP8 weights)."""
    param_codec: ParamCodec | None = None
    reshard_after_forward: bool | int | None = None
    """FSDP2's: None (True but for the root), True, False, or an int, the number of
    consecutive ranks of the shard group that keep each unit's weights between forward and
    backward (the seed API's ``reshard_after_forward_group_size``)."""
    fine_grained_param_gather: bool = False
    """The seed's ``enable_fine_grained_param_gather``: each parameter-holding leaf module
    of a unit (a Linear, a norm) becomes a unit of its own, gathered just before it runs and
    prefetched one ahead, so a unit's forward holds about one leaf's unsharded weights
    instead of the whole unit's. Leaves whose parameters are shared elsewhere (tied
    weights) stay in their unit. ZeRO-3 only: other strategies gather nothing per forward."""
    max_inflight_reductions: int = 1
    prefetch_depth: int = 1
    prefetch_numel: int | None = None
    """The reference's ``suggested_communication_unit_size`` (see ``RootOptions``)."""
    coalesce_prefetch: bool = False
    """The reference's merging of small units (see ``RootOptions``)."""
    max_bucket_numel: int | None = None
    """The reference's ``bucket_size`` (see ``UnitOptions``)."""
    reduce_scatter_in_no_sync: bool = True
    """Megatron-FSDP's ``no_sync`` (see ``RootOptions``; the per-module ``fully_shard``
    defaults to FSDP2's, False)."""
    offload_policy: OffloadPolicy | None = None
    """FSDP2's ``CPUOffloadPolicy`` (the seed API's ``optimizer_cpu_offload``): the sharded main
    weights, their gradients and the optimizer step on the host (``config.offload``)."""
    check_replicas: bool = True
    """Each unit's wrap compares the values of its weights across the ranks and raises when
    they differ (``fully_shard(check_replicas=...)``); False when the weights are loaded into
    the sharded model after wrapping."""

    def __post_init__(self) -> None:
        strategy = parse_strategy(self.zero_dp_strategy, "zero_dp_strategy")
        object.__setattr__(self, "zero_dp_strategy", strategy)
        policy = self.mixed_precision_policy
        if policy is not None:
            object.__setattr__(self, "mixed_precision_policy", from_fsdp2_policy(policy))
        object.__setattr__(self, "param_codecs", tuple(self.param_codecs))
