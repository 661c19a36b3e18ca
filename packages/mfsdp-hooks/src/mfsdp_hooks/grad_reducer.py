"""The gradient side of one parameter group: collect a backward's gradients, reduce them.

A ``GradReducer`` takes each parameter's unsharded gradient as autograd delivers it and,
once the unit's backward is done, launches one collective that reduces them into the
group's ``GradShard`` (the ``.grad`` the optimizer reads): a reduce-scatter for the sharding
strategies, an all-reduce for ``no_shard``. What is in flight is a ``PendingReduction``,
which only the root's ``ReductionQueue`` holds and waits on; waiting it also releases the
reducer's buffers.

Where the shared-memory host transport carries the reduce-scatter, the reducer keeps
autograd's per-parameter gradients and the transport reads them in place (``FlatPieces``);
elsewhere they are copied on arrival into a temporary unsharded buffer in the reduce dtype,
and a pre-scale (1/N, ``gradient_scaling_factor``) rides on that copy.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from mfsdp_buffers import Allocator, FlatLayout, FlatPieces, release_to
from mfsdp_collectives import (
    CommHandle,
    CommStreams,
    FSDPTopology,
    all_reduce_,
    hsdp_reduce_scatter_into,
)
from mfsdp_hooks.grad_allocator import pools_memory
from mfsdp_hooks.grad_shard import GradShard
from mfsdp_hooks.reduce_config import GradReduceConfig
from mfsdp_hooks.strategy import ShardingStrategy

__all__ = ["GradReducer", "PendingReduction"]


@dataclass
class PendingReduction:
    """One launched gradient reduction; ``wait()`` completes it and frees its buffers."""

    reducer: GradReducer
    handle: CommHandle
    # no_shard: where the all-reduced buffer goes, and whether it adds to what is there.
    no_shard_target: tuple[torch.Tensor, bool] | None
    outer_only: bool = False  # HSDP: only the shard's all-reduce across the replicas
    done: bool = False

    def wait(self) -> None:
        if self.done:
            return
        self.done = True
        self.handle.wait()
        self.reducer.release(self)


class ReplicaSync(enum.Enum):
    """How far a gradient shard is reduced across the HSDP replicas in this cycle.

    ``EMPTY`` (nothing in it) -> ``INNER_ONLY`` (a ``no_sync`` micro-batch's reduction stayed
    in the shard group) -> ``COMPLETE`` (the reduction that ends the cycle took the whole
    shard across the replicas). A reduction from ``EMPTY`` or ``COMPLETE`` that ends the cycle
    reduces only its own part across them; a fresh shard (``zero_grad``) starts ``EMPTY``.
    Without HSDP every reduction goes to ``COMPLETE``.
    """

    EMPTY = "empty"
    INNER_ONLY = "inner_only"
    COMPLETE = "complete"


class GradReducer:
    """Accumulates one group's gradients within a backward and reduces them into its shard."""

    def __init__(
        self,
        layout: FlatLayout,
        grads: GradShard,
        dist_params: Sequence[nn.Parameter],
        *,
        topology: FSDPTopology,
        strategy: ShardingStrategy,
        reduce_dtype: torch.dtype,
        reduce_config: GradReduceConfig,
        allocator: Allocator,
    ) -> None:
        self.layout = layout
        self.grads = grads
        self._dist_params = list(dist_params)
        self._topology = topology
        self._strategy = strategy
        self.reduce_dtype = reduce_dtype
        self._allocator = allocator
        count = len(layout.placements)
        self.expected = count
        self.received = 0
        # Per-parameter gradients are kept as they arrive when the reduce-scatter can read
        # them in place; a pre-scale then becomes the same post-scale on the output shard.
        in_place = (
            topology.device.type == "cpu"
            and strategy != ShardingStrategy.NO_SHARD
            and not pools_memory(allocator)
            and topology.host_transport is not None
        )
        native_average = in_place or dist.get_backend(topology.shard_group) != "gloo"
        # HSDP: the mean is over every data-parallel rank, inside and across the replicas.
        self._average, self._input_scale = reduce_config.collective_args(
            topology.shard_size * topology.outer_size, native_average
        )
        self._output_scale: float | None = None
        self._held: list[torch.Tensor | None] | None = None
        if in_place:
            self._held = [None] * count
            self._output_scale, self._input_scale = self._input_scale, None
        self._gaps = layout.padding_gaps()
        self._buffer: torch.Tensor | None = None
        self._filled = [False] * count
        self._across_replicas = ReplicaSync.EMPTY

    # ----------------------------------------------------------------- collect
    def begin_backward(self) -> None:
        self.received = 0

    @property
    def all_received(self) -> bool:
        return self.received >= self.expected

    def accumulate(self, index: int, grad: torch.Tensor) -> bool:
        """Take one parameter's unsharded gradient (kept, or added into the reduce buffer).

        The caller makes sure no reduction of this reducer is in flight (its buffer may be
        reused). Returns True when every gradient of the group has arrived in this backward.
        """
        flat = grad.reshape(-1)
        if self._held is not None:
            self._hold(index, flat)
        else:
            self._copy_in(index, flat)
        self.received += 1
        return self.all_received

    def _hold(self, index: int, flat_grad: torch.Tensor) -> None:
        """Keep autograd's gradient itself (the caller dropped ``param.grad``: it is ours)."""
        assert self._held is not None
        held = self._held[index]
        if held is None:
            self._held[index] = flat_grad
            return
        if held.dtype != self.reduce_dtype:
            held = held.to(self.reduce_dtype)
        with torch.no_grad():
            self._held[index] = held.add_(flat_grad)

    def _allocate(self) -> torch.Tensor:
        if self._buffer is None:
            self._buffer = self._allocator.allocate(
                ("grad", id(self)), self.layout.padded_numel, self.reduce_dtype, self.grads.device
            )
        return self._buffer

    def _copy_in(self, index: int, flat_grad: torch.Tensor) -> None:
        placement = self.layout.placements[index]
        slot = self._allocate()[placement.offset : placement.offset + placement.numel]
        scale = self._input_scale
        with torch.no_grad():
            # A pre-scale (1/N, gradient_scaling_factor) rides on the copy we make anyway,
            # instead of a separate scaled copy of the whole bucket before the collective.
            if self._filled[index]:
                slot.add_(flat_grad, alpha=1.0 if scale is None else scale)
            elif scale is None:
                slot.copy_(flat_grad)
            else:
                torch.mul(flat_grad, scale, out=slot)
            self._filled[index] = True

    @property
    def has_local_grads(self) -> bool:
        if self._held is not None:
            return any(g is not None for g in self._held)
        return self._buffer is not None

    # ----------------------------------------------------------------- reduce
    def _held_pieces(self) -> FlatPieces:
        assert self._held is not None
        placements = self.layout.placements
        return FlatPieces(
            self.layout.padded_numel,
            [(placements[i].offset, grad) for i, grad in enumerate(self._held) if grad is not None],
            dtype=self.reduce_dtype,
            device=self.grads.device,
        )

    def _complete_buffer(self) -> torch.Tensor:
        """The reduce buffer with padding and missing gradients zeroed."""
        buffer = self._allocate()
        with torch.no_grad():
            for start, end in self._gaps:
                buffer[start:end].zero_()
            for index, filled in enumerate(self._filled):
                if not filled:
                    placement = self.layout.placements[index]
                    buffer[placement.offset : placement.offset + placement.numel].zero_()
        return buffer

    @property
    def needs_outer_sync(self) -> bool:
        """Its shard holds parts not yet reduced across the HSDP replicas."""
        return self._across_replicas is ReplicaSync.INNER_ONLY

    def launch(self, streams: CommStreams | None, *, ends_cycle: bool = True) -> PendingReduction:
        """Issue the reduction of what was collected into the gradients the optimizer reads.

        HSDP: a reduction that does not end the optimisation cycle (a ``no_sync`` micro-batch)
        stays inside the shard group; the one that ends it reduces the whole shard across
        the replicas, so each replica's accumulated gradient crosses them once per cycle.
        """
        target, accumulate = self.grads.prepare(self._dist_params)
        if not accumulate:
            self._across_replicas = ReplicaSync.EMPTY
        group, outer = self._topology.shard_group, self._topology.outer_group
        if outer is not None and not self.has_local_grads and self.needs_outer_sync:
            handle = all_reduce_(target, outer, average=self._average, stream=streams)
            self._across_replicas = ReplicaSync.COMPLETE
            return PendingReduction(self, handle, no_shard_target=None, outer_only=True)
        if self._strategy == ShardingStrategy.NO_SHARD:  # never held: no transport all-reduce
            handle = all_reduce_(
                self._complete_buffer(),
                group,
                average=self._average,
                stream=streams,
                outer_group=outer,
            )
            return PendingReduction(self, handle, no_shard_target=(target, accumulate))
        grads = self._held_pieces() if self._held is not None else self._complete_buffer()
        state = self._across_replicas
        defer = outer is not None and not ends_cycle and state is not ReplicaSync.COMPLETE
        handle = hsdp_reduce_scatter_into(
            grads,
            target,
            group,
            None if defer else outer,
            average=self._average,
            post_scale=self._output_scale,
            accumulate=accumulate,
            stream=streams,
            transport=self._topology.host_transport,
            outer_reduces_output=state is ReplicaSync.INNER_ONLY,
        )
        self._across_replicas = ReplicaSync.INNER_ONLY if defer else ReplicaSync.COMPLETE
        return PendingReduction(self, handle, no_shard_target=None)

    def release(self, pending: PendingReduction) -> None:
        """After ``pending`` landed: move a ``no_shard`` result in place, free the buffers."""
        if pending.outer_only:
            return  # it reduced the shard in place and used no collected gradients
        if self._held is not None:
            self._held = [None] * len(self._filled)
            return
        buffer = self._buffer
        assert buffer is not None
        if pending.no_shard_target is not None:
            target, accumulate = pending.no_shard_target
            with torch.no_grad():
                if accumulate:
                    target.add_(buffer)
                else:
                    target.copy_(buffer)
        release_to(self._allocator, ("grad", id(self)), buffer)
        self._buffer = None
        self._filled = [False] * len(self._filled)
