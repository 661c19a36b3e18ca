"""FSDP2's ``FSDPModule`` methods whose machinery ours does not have: each raises, naming
itself and what to do, instead of reaching FSDP2's private state (which our units lack)."""

from __future__ import annotations

from typing import NoReturn

__all__ = ["FSDP2Refusals"]


def _not_yet(method: str, why: str) -> NoReturn:
    raise NotImplementedError(f"{method} is not supported yet by megatron-fsdp: {why}")


class FSDP2Refusals:
    """Mixed in before torch's ``FSDPModule``: its methods we do not implement."""

    def set_reduce_scatter_unused_params(
        self, reduce_scatter_unused_params: bool, *, recurse: bool = True
    ) -> None:
        _not_yet(
            "set_reduce_scatter_unused_params",
            "a unit that ran reduces every parameter (missing gradients as zeros)",
        )

    def set_reduce_scatter_max_input_buffers(
        self, max_input_buffers: int, *, recurse: bool = True
    ) -> None:
        _not_yet(
            "set_reduce_scatter_max_input_buffers",
            "pass max_inflight_reductions to the root's fully_shard",
        )

    def set_separate_reduce_scatter_group(
        self, enable: bool = True, *, recurse: bool = True
    ) -> None:
        _not_yet(
            "set_separate_reduce_scatter_group",
            "a separate NCCL communicator for reduce-scatters is not built; on CPU they already "
            "run beside the all-gathers (the shared-memory transport's second lane, gloo's "
            "worker threads)",
        )

    def set_unshard_in_backward(self, unshard_in_backward: bool) -> None:
        if unshard_in_backward is not True:
            _not_yet("set_unshard_in_backward(False)", "every unit is gathered for backward")

    def set_allocate_memory_from_process_group_for_comm(self, enable: bool) -> None:
        if enable:
            _not_yet(
                "set_allocate_memory_from_process_group_for_comm(True)",
                "comm buffers come from the grad_buffer_allocator (nccl_ub on CUDA)",
            )

    def set_symm_mem_for_comm(self, backend: str = "NCCL") -> None:
        _not_yet("set_symm_mem_for_comm", "symmetric memory is not wired to the collectives")

    def _set_unshard_async_op(self, async_op: bool) -> None:
        _not_yet("_set_unshard_async_op", "the pre-forward unshard's op is not configurable")

    def _get_fsdp_state(self) -> NoReturn:
        raise NotImplementedError(
            f"{type(self).__name__} is sharded by megatron-fsdp, which keeps no FSDP2 state: "
            "code that reads FSDP2's private state (fully_shard.state, FSDPParamGroup) needs "
            "megatron-fsdp's public calls instead (see docs/differences-from-fsdp2.md)"
        )
