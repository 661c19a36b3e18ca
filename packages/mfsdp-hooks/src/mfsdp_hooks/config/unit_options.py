"""The choices ``fully_shard`` makes for one FSDP unit, and which of them the root owns."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mfsdp_buffers import Allocator
from mfsdp_collectives import FSDPTopology
from mfsdp_hooks.config.codec import IDENTITY, ParamClassCodec, ParamCodec
from mfsdp_hooks.config.experts import ExpertSharding
from mfsdp_hooks.config.mixed_precision import MixedPrecisionPolicy
from mfsdp_hooks.config.reduce_config import GradReduceConfig
from mfsdp_hooks.config.strategy import ShardingStrategy

__all__ = ["ROOT_LEVEL_OPTIONS", "UnitOptions"]


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
    reshard_after_backward: bool = True
    overlap_param_gather: bool = True
    overlap_grad_reduce: bool = True
    sync_model_each_microbatch: bool = True
    report_nan_in_param_grad: bool = False
    max_inflight_reductions: int = 1
    prefetch_depth: int = 1
    backward_prefetch_grad_fraction: float = 0.5
    grad_allocator: Allocator | None = None
    codec: ParamCodec = IDENTITY
    codecs: tuple[ParamClassCodec, ...] = ()
    """Codecs that claim tensor-subclass parameters (FP8): their own groups, bound codecs."""
    experts: ExpertSharding | None = None
    """Expert parallelism: the unit's expert parameters go to groups over the EDP group."""


# Options the root reads for the whole tree (the reduction queue, gradient sync, prefetch
# order). A non-root unit given another value than its root's would see it silently ignored,
# so the root refuses that when it is built (``FSDPRoot.__init__``).
ROOT_LEVEL_OPTIONS = (
    "overlap_grad_reduce",
    "sync_model_each_microbatch",
    "report_nan_in_param_grad",
    "max_inflight_reductions",
    "prefetch_depth",
)


def claiming_codec(options: UnitOptions, param: torch.Tensor) -> ParamClassCodec | None:
    """The first of ``options.codecs`` that claims ``param``, if any."""
    return next((c for c in options.codecs if c.claims(param)), None)
