"""FSDP2's communication hooks of one unit, and where the engine cannot honour them.

``FSDPModule.set_custom_all_gather``, ``set_custom_reduce_scatter``, ``set_all_reduce_hook``
and ``set_force_sum_reduction_for_comms`` each change one field of the unit's ``CommHooks``
(the unit owns it, ``FSDPUnit.set_comm_hooks``); the unit's parameter groups take the
all-gather comm, their reducers the rest:

- ``all_gather``: every all-gather of the unit's weights over the shard group runs through it
  (``mfsdp_collectives.comms.custom_comms``), and so does the backward gather over the smaller
  group of an int ``reshard_after_forward``, as FSDP2's, unless the comm cannot regather
  its own output exactly (``regathers_exactly``: block quantization), when it is exact;
- ``reduce_scatter``: the gradient reduce-scatter runs through it, and the unsharded gradient
  buffer it reads comes from its ``allocate``;
- ``all_reduce_hook``: called with the reduced gradient shard, in the reduce dtype, after the
  reduce-scatter (FSDP) or the all-reduce across the replicas (HSDP), before any divide still
  owed and before it is stored into ``.grad``, as FSDP2 calls it;
- ``force_sum``: every gradient collective sums (never ``ReduceOp.AVG``) and the mean is a
  divide of the output.
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
