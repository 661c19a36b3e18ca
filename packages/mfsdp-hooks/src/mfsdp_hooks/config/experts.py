"""Expert parallelism: expert parameters sharded and reduced over the expert-data-parallel
(EDP) group, in parameter groups of their own (the package README's "Expert parallelism").

Gradient scale: an expert's gradient on its rank already sums the contributions of every
token its EP group routed to it. Averaged over EDP that is ``dp_size / edp_size`` times the
gradient of the global mean loss, so the expert mean divides by the dense DP size instead
(``mean_over``), and a one-process model and the sharded one step alike.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

from torch import nn

from mfsdp_collectives import FSDPTopology, register_group_name
from mfsdp_hooks.config.reduce_config import GradReduceConfig

__all__ = ["ExpertSharding", "is_megatron_expert"]


def is_megatron_expert(name: str, param: nn.Parameter) -> bool:
    """Megatron-Core's marking: expert parameters carry ``allreduce=False``."""
    return getattr(param, "allreduce", True) is False


@dataclass(frozen=True)
class ExpertSharding:
    """Where a unit's expert parameters are sharded, and how their gradients are averaged."""

    topology: FSDPTopology
    """The EDP topology: expert parameters are sharded and reduced over its shard group."""
    mean_over: int
    """The dense data-parallel size: an expert gradient's mean divides by it."""
    is_expert: Callable[[str, nn.Parameter], bool] = is_megatron_expert
    """Which parameters are experts (by their name within the unit): the same rule on every
    rank, as it decides which groups, hence which collectives, each parameter joins."""

    def __post_init__(self) -> None:
        if isinstance(self.mean_over, bool) or not isinstance(self.mean_over, int):
            raise TypeError(f"mean_over must be an int, got {self.mean_over!r}")
        if self.mean_over < 1 or self.mean_over % self.topology.shard_size:
            raise ValueError(
                f"mean_over={self.mean_over} must be the data-parallel size, a multiple of the "
                f"expert-data-parallel size {self.topology.shard_size}"
            )

    def adopted(self, host_transport: str) -> ExpertSharding:
        """What ``fully_shard`` makes of this sharding at wrap time: the EDP group takes the
        role name ``expert_dp`` (so the comm tracer and error messages tell the EDP hop from
        the dense one), over the topology with its CPU transport chosen
        (``FSDPTopology.with_host_transport``: collective over the EDP group unless
        ``"gloo"``)."""
        register_group_name(self.topology.shard_group, "expert_dp")
        return dataclasses.replace(self, topology=self.topology.with_host_transport(host_transport))

    def describe(self) -> str:
        """What must agree across ranks (no addresses)."""
        rule = getattr(self.is_expert, "__qualname__", type(self.is_expert).__name__)
        return f"edp={self.topology.shard_size}, mean_over={self.mean_over}, rule={rule}"

    def reduce_config(self, dense: GradReduceConfig) -> GradReduceConfig:
        """The dense gradient options, with the mean taken over the dense DP size."""
        return dataclasses.replace(dense, mean_over=self.mean_over)
