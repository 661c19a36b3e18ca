"""FSDP2's four communication-hook setters on our ``FSDPModule`` (mixed into it), one unit
at a time as FSDP2's: each checks its argument and hands it to ``runtime.comm_hook_setter``;
``config.comm_hooks`` says where the engine cannot honour a hook."""

from __future__ import annotations

from collections.abc import Callable

import torch

from mfsdp_collectives import AllGatherComm, ReduceScatterComm, check_comm
from mfsdp_hooks.runtime.comm_hook_setter import set_comm_hooks
from mfsdp_hooks.runtime.unit import FSDPUnit, unit_of

__all__ = ["FSDP2CommHooks"]


class FSDP2CommHooks:
    """Mixed in before torch's ``FSDPModule``: FSDP2's communication-hook setters."""

    def _mfsdp_unit(self) -> FSDPUnit:
        unit = unit_of(self)  # type: ignore[arg-type]
        assert unit is not None, "mixed into fully-sharded modules only"
        return unit

    def set_custom_all_gather(self, comm: AllGatherComm) -> None:
        """Run this module's all-gathers through ``comm`` (FSDP2's ``AllGather``: its
        ``allocate`` gives the gather's buffer, its call runs it), the backward gather over the
        smaller group of an int ``reshard_after_forward`` too, as FSDP2's, unless the comm
        cannot regather its own output exactly (``regathers_exactly``), which then travels
        exactly. Costs one copy of the gathered weights out of the comm's buffer, as in
        FSDP2, unless the comm ``uses_caller_buffers``
        (``mfsdp_collectives.comms.custom_comms``)."""
        check_comm(comm, "comm")
        set_comm_hooks(self._mfsdp_unit(), all_gather=comm)

    def set_custom_reduce_scatter(self, comm: ReduceScatterComm) -> None:
        """Run this module's gradient reduce-scatter through ``comm`` (FSDP2's
        ``ReduceScatter``); the unsharded gradient buffer and the output come from its
        ``allocate``, or are the engine's own where it ``uses_caller_buffers``."""
        check_comm(comm, "comm")
        set_comm_hooks(self._mfsdp_unit(), reduce_scatter=comm)

    def set_all_reduce_hook(
        self, hook: Callable[[torch.Tensor], None], *, stream: torch.Stream | None = None
    ) -> None:
        """Call ``hook(reduced)`` on this module's reduced gradient shard (reduce dtype) after
        the reduce-scatter (FSDP) or the all-reduce across replicas (HSDP), before any divide
        still owed and before it is stored into ``.grad``, as FSDP2 does; ``stream``
        (accelerators, not HSDP): run it there."""
        if not callable(hook):
            raise TypeError(f"hook must be callable, got {type(hook).__name__}")
        set_comm_hooks(self._mfsdp_unit(), all_reduce_hook=hook, all_reduce_hook_stream=stream)

    def set_force_sum_reduction_for_comms(self, enable: bool) -> None:
        """Only ever ``ReduceOp.SUM`` in this module's gradient collectives: a mean becomes a
        sum and a divide of the output (NCCL's zero-copy paths need SUM)."""
        if not isinstance(enable, bool):
            raise ValueError(f"enable must be a bool, got {enable!r}")
        set_comm_hooks(self._mfsdp_unit(), force_sum=enable)
