"""FSDP2's communication hooks of one unit, ``CommHooks`` (the unit owns it,
``FSDPUnit.set_comm_hooks``; its parameter groups take the all-gather comm, their reducers
the rest), and where the engine cannot honour them. What each hook does: the setters on
``FSDPModule`` (``api.fsdp2_comm_hooks``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from mfsdp_collectives import AllGatherComm, FSDPTopology, ReduceScatterComm
from mfsdp_hooks.config.strategy import ShardingStrategy

__all__ = ["CommHooks", "check_comm_hooks"]


@dataclass(frozen=True)
class CommHooks:
    """The communication hooks a unit was given (none by default)."""

    all_gather: AllGatherComm | None = None
    reduce_scatter: ReduceScatterComm | None = None
    all_reduce_hook: Callable[[torch.Tensor], None] | None = None
    all_reduce_hook_stream: torch.Stream | None = None
    force_sum: bool = False

    def after_reduce(self) -> Callable[[torch.Tensor], None] | None:
        """The all-reduce hook as the collectives call it: on its own stream when given one
        (ordered after the reduction and before what follows it), else where the reduction
        finishes."""
        hook, stream = self.all_reduce_hook, self.all_reduce_hook_stream
        if hook is None or stream is None:
            return hook
        user_hook, user_stream = hook, stream

        def on_stream(reduced: torch.Tensor) -> None:
            finishing = torch.accelerator.current_stream(reduced.device)
            user_stream.wait_stream(finishing)
            with user_stream:
                user_hook(reduced)
            finishing.wait_stream(user_stream)

        return on_stream


def check_comm_hooks(
    hooks: CommHooks,
    unit: str,
    *,
    strategy: ShardingStrategy,
    topology: FSDPTopology,
) -> None:
    """Raise, naming the unit and the setter, where the engine would not honour ``hooks``
    (before any collective runs with them)."""
    custom = hooks.all_gather is not None or hooks.reduce_scatter is not None
    if (custom or hooks.all_reduce_hook is not None) and (
        strategy == ShardingStrategy.NO_SHARD or topology.shards_optimizer_across_outer
    ):
        layout = "no_shard" if strategy == ShardingStrategy.NO_SHARD else "HFSDP (outer optimizer)"
        raise NotImplementedError(
            f"FSDP unit {unit}: custom comms and the all-reduce hook are not supported yet "
            f"with {layout}: its gradients do not travel as one reduce-scatter in the shard "
            "group; use plain FSDP or HSDP for this unit"
        )
    if hooks.all_reduce_hook_stream is not None:
        if topology.outer_group is not None:
            raise ValueError(
                f"FSDP unit {unit}: set_all_reduce_hook(stream=...) cannot be used with HSDP; "
                "the hook runs where the all-reduce across the replicas finishes (as FSDP2's)"
            )
        if topology.device.type == "cpu":
            raise ValueError(
                f"FSDP unit {unit}: set_all_reduce_hook(stream=...) needs an accelerator; "
                "on CPU there are no streams: leave stream=None"
            )
