"""The choices ``fully_shard`` makes for one FSDP unit, and the root-level ones among them.

Every unit carries the ``RootOptions`` its ``fully_shard`` call was given; once the root is
built, the root unit's are the tree's (``FSDPRoot.root_options``), the one copy its setters
change, and a non-root unit given other values is refused (they would be ignored silently).
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch

from mfsdp_buffers import Allocator
from mfsdp_collectives import FSDPTopology, PostForwardGroup
from mfsdp_hooks.config.codec import IDENTITY, ParamClassCodec, ParamCodec
from mfsdp_hooks.config.experts import ExpertSharding
from mfsdp_hooks.config.mixed_precision import MixedPrecisionPolicy
from mfsdp_hooks.config.offload import HostOffload
from mfsdp_hooks.config.reduce_config import GradReduceConfig
from mfsdp_hooks.config.strategy import ShardingStrategy

__all__ = ["RootOptions", "UnitOptions"]


@dataclass(frozen=True)
class RootOptions:
    """Choices the root makes for every unit under it."""

    overlap_grad_reduce: bool = True
    sync_model_each_microbatch: bool = True
    report_nan_in_param_grad: bool = False
    max_inflight_reductions: int = 1
    prefetch_depth: int = 1
    prefetch_numel: int | None = None
    """The reference's ``suggested_communication_unit_size``: units are gathered ahead while
    their unsharded elements sum to at most this (a unit larger than it is not prefetched:
    a small value turns prefetching off); None: ``prefetch_depth`` units."""
    coalesce_prefetch: bool = False
    """The reference's merging of small units up to ``suggested_communication_unit_size``:
    the units a prefetch gathers ahead go out together, one all-gather per group and dtype,
    issued once the next unit is no longer on its way (``runtime.gather_ahead``)."""
    reduce_scatter_in_no_sync: bool = False
    """Under ``no_sync`` / ``set_requires_gradient_sync(False)``: False (FSDP2's) keeps a
    unit's unsharded gradients local until a synced backward reduces them with its own;
    True (Megatron-FSDP's, which its root wrapper sets) still reduce-scatters each
    micro-batch of ZeRO-2/3 units inside ``dp_shard``, so gradient memory stays sharded,
    and only the hop across HSDP replicas waits for the synced backward."""

    def differences(self, other: RootOptions) -> list[tuple[str, object, object]]:
        """(name, mine, other's) for each field where the two differ."""
        return [
            (f.name, getattr(self, f.name), getattr(other, f.name))
            for f in fields(self)
            if getattr(self, f.name) != getattr(other, f.name)
        ]


@dataclass(frozen=True)
class UnitOptions:
    """Per-unit choices; the root unit's root-level choices apply to the whole tree."""

    topology: FSDPTopology
    strategy: ShardingStrategy
    policy: MixedPrecisionPolicy
    reduce_config: GradReduceConfig
    reshard_after_forward: bool | None = None
    """None: FSDP2's default, True for every unit but the root (whose weights backward needs
    at once); True or False: as given, the root included."""
    reshard_after_forward_group_size: int | None = None
    """FSDP2's int ``reshard_after_forward``: after forward the weights are kept sharded over
    this many consecutive ranks of the shard group (``post_forward``), so the backward
    all-gather stays among them; None: over the whole shard group."""
    post_forward: PostForwardGroup | None = None
    """That smaller group, made once the ranks agreed on the options (a collective)."""
    reshard_after_backward: bool = True
    overlap_param_gather: bool = True
    root: RootOptions = RootOptions()
    """The root-level options this unit's call was given; the tree runs under its root's."""
    backward_prefetch_grad_fraction: float = 0.5
    grad_allocator: Allocator | None = None
    codec: ParamCodec = IDENTITY
    codecs: tuple[ParamClassCodec, ...] = ()
    """Codecs that claim tensor-subclass parameters (FP8): their own groups, bound codecs."""
    experts: ExpertSharding | None = None
    """Expert parallelism: the unit's expert parameters go to groups over the EDP group."""
    max_bucket_numel: int | None = None
    """The reference's ``bucket_size``: a unit's parameters of one kind are split into
    groups (one collective each) of at most this many elements (a larger parameter gets one
    of its own); None: one group per kind. All of a unit's groups are gathered together."""
    shard_dims: tuple[tuple[str, int], ...] = ()
    """FSDP2's ``shard_placement_fn``: ``(name, dim)`` of the parameters cut along another dim
    than 0 (``ShardCuts`` stores them with that dim first)."""
    offload: HostOffload | None = None
    """FSDP2's ``CPUOffloadPolicy`` on an accelerator (or forced, in tests): the unit's main
    weights, gradients and optimizer state live on the host (``config.offload``)."""


def claiming_codec(options: UnitOptions, param: torch.Tensor) -> ParamClassCodec | None:
    """The first of ``options.codecs`` that claims ``param``, if any."""
    return next((c for c in options.codecs if c.claims(param)), None)
