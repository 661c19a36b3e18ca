"""The gradient side of one parameter group: collect a backward's gradients, reduce them.

A ``GradReducer`` takes each parameter's unsharded gradient as autograd delivers it and,
once the unit's backward is done, launches one collective that reduces them into the
group's ``GradShard`` (the ``.grad`` the optimizer reads): a reduce-scatter for the sharding
strategies, an all-reduce for ``no_shard``. What is in flight is a ``PendingReduction``,
which only the root's ``ReductionQueue`` holds and waits on; waiting it also releases the
reducer's buffers.

HFSDP (optimizer state sharded across ``dp_outer`` too) reduce-scatters at both levels: a
``no_sync`` micro-batch's reduction stays in the shard group, summed into a ``partial``
compute-shard buffer held until the cycle ends; the reduction that ends it takes the partial
across ``dp_outer`` into the sub-shard the optimizer reads.

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

from mfsdp_buffers import Allocator, FlatLayout
from mfsdp_collectives import (
    CommHandle,
    CommStreams,
    FSDPTopology,
    all_reduce_,
    hfsdp_reduce_scatter_into,
    hsdp_reduce_scatter_into,
    reduce_scatter_into,
)
from mfsdp_hooks.config.grad_allocator import pools_memory
from mfsdp_hooks.config.reduce_config import GradReduceConfig
from mfsdp_hooks.config.strategy import ShardingStrategy
from mfsdp_hooks.grads.grad_collector import GradCollector
from mfsdp_hooks.grads.grad_shard import GradShard

__all__ = ["GradReducer", "PendingReduction"]


@dataclass
class PendingReduction:
    """One launched gradient reduction; ``wait()`` completes it and frees its buffers."""

    reducer: GradReducer
    handle: CommHandle
    # no_shard: where the all-reduced buffer goes, and whether it adds to what is there.
    no_shard_target: tuple[torch.Tensor, bool] | None
    outer_only: bool = False  # only the reduction across dp_outer of what a no_sync kept
    ends_partial: bool = False  # HFSDP: the partial crossed dp_outer; free it once landed
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
    Without HSDP every reduction goes to ``COMPLETE``. Under HFSDP the parts kept inside the
    shard group live in the reducer's partial buffer, not in the shard: ``INNER_ONLY`` means
    the partial holds them, and ``zero_main_grads`` drops them with the gradients.
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
        # Per-parameter gradients are kept as they arrive when the reduce-scatter can read
        # them in place; a pre-scale then becomes the same post-scale on the output shard.
        in_place = (
            topology.device.type == "cpu"
            and strategy != ShardingStrategy.NO_SHARD
            and not pools_memory(allocator)
            and topology.host_transport is not None
        )
        self._in_place = in_place
        self._native_average = in_place or dist.get_backend(topology.shard_group) != "gloo"
        self._collector = GradCollector(
            layout,
            reduce_dtype=reduce_dtype,
            device=grads.device,
            allocator=allocator,
            hold=in_place,
            input_scale=None,
        )
        self.configure(reduce_config)
        self._across_replicas = ReplicaSync.EMPTY
        self._partial: torch.Tensor | None = None

    def configure(self, reduce_config: GradReduceConfig) -> None:
        """How gradients are scaled and averaged from the next reduction on."""
        topology = self._topology
        # HSDP: the mean is over every data-parallel rank, inside and across the replicas.
        self._average, self._input_scale = reduce_config.collective_args(
            topology.shard_size * topology.outer_size, self._native_average
        )
        self._output_scale: float | None = None
        if self._in_place:  # kept as they arrive: a pre-scale becomes the same post-scale
            self._output_scale, self._input_scale = self._input_scale, None
        self._collector.input_scale = self._input_scale

    # ----------------------------------------------------------------- collect
    def accumulate(self, index: int, grad: torch.Tensor) -> bool:
        """Take parameter ``index``'s unsharded gradient of this backward; True once every
        gradient of the group arrived. No reduction of this group may be in flight (the
        caller settles it first: the buffer may be reused)."""
        return self._collector.accumulate(index, grad)

    @property
    def all_received(self) -> bool:
        """Every gradient of the group arrived in this backward."""
        return self._collector.all_received

    @property
    def has_grads(self) -> bool:
        """Gradients were collected and not reduced yet (this backward's or ``no_sync``'s)."""
        return self._collector.has_grads

    def begin_backward(self) -> None:
        """A new backward: count arrivals afresh (what ``no_sync`` kept stays)."""
        self._collector.begin_backward()

    # ----------------------------------------------------------------- reduce
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
        if self._topology.shards_optimizer_across_outer:
            return self._launch_to_sub_shard(streams, ends_cycle=ends_cycle)
        target, accumulate = self.grads.prepare(self._dist_params)
        if not accumulate:
            self._across_replicas = ReplicaSync.EMPTY
        group, outer = self._topology.shard_group, self._topology.outer_group
        if outer is not None and not self._collector.has_grads and self.needs_outer_sync:
            handle = all_reduce_(target, outer, average=self._average, stream=streams)
            self._across_replicas = ReplicaSync.COMPLETE
            return PendingReduction(self, handle, no_shard_target=None, outer_only=True)
        if self._strategy == ShardingStrategy.NO_SHARD:  # never held: no transport all-reduce
            buffer = self._collector.collected()
            assert isinstance(buffer, torch.Tensor)
            handle = all_reduce_(
                buffer,
                group,
                average=self._average,
                stream=streams,
                outer_group=outer,
            )
            return PendingReduction(self, handle, no_shard_target=(target, accumulate))
        grads = self._collector.collected()
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

    def _partial_buffer(self) -> torch.Tensor:
        """The cycle's compute-shard gradient, in the gradients' dtype (micro-batches add
        into it); not from the allocator, whose buffers live for one reduction."""
        if self._partial is None:
            self._partial = self.grads.new_flat(self.layout.shard_numel)
        return self._partial

    def drop_partial(self) -> None:
        """Forget the ``no_sync`` parts kept in the shard group (the gradients were zeroed)."""
        self._partial = None
        if self._across_replicas is ReplicaSync.INNER_ONLY:
            self._across_replicas = ReplicaSync.EMPTY

    def _launch_to_sub_shard(
        self, streams: CommStreams | None, *, ends_cycle: bool
    ) -> PendingReduction:
        """HFSDP: reduce-scatter in the shard group into the partial; the reduction that
        ends the cycle reduce-scatters the partial across ``dp_outer`` into the sub-shard."""
        topology, outer = self._topology, self._topology.outer_group
        assert outer is not None, "HFSDP without an outer group"
        kept = self._across_replicas is ReplicaSync.INNER_ONLY
        if not ends_cycle:
            handle = reduce_scatter_into(
                self._collector.collected(),
                self._partial_buffer(),
                topology.shard_group,
                average=self._average,
                post_scale=self._output_scale,
                reduce_dtype=self.reduce_dtype,
                accumulate=kept,
                stream=streams,
                transport=topology.host_transport,
            )
            self._across_replicas = ReplicaSync.INNER_ONLY
            return PendingReduction(self, handle, no_shard_target=None)
        target, accumulate = self.grads.prepare(self._dist_params)
        self._across_replicas = ReplicaSync.COMPLETE
        if not self._collector.has_grads:  # finish_grad_sync: only what no_sync kept is left
            handle = reduce_scatter_into(
                self._partial_buffer(),
                target,
                outer,
                average=self._average,
                reduce_dtype=self.reduce_dtype,
                accumulate=accumulate,
                stream=streams,
                transport=topology.outer_transport,
            )
            return PendingReduction(self, handle, None, outer_only=True, ends_partial=True)
        handle = hfsdp_reduce_scatter_into(
            self._collector.collected(),
            target,
            topology.shard_group,
            outer,
            partial=self._partial_buffer(),
            partial_accumulate=kept,
            average=self._average,
            post_scale=self._output_scale,
            reduce_dtype=self.reduce_dtype,
            accumulate=accumulate,
            stream=streams,
            transport=topology.host_transport,
            outer_transport=topology.outer_transport,
        )
        return PendingReduction(self, handle, no_shard_target=None, ends_partial=True)

    def release(self, pending: PendingReduction) -> None:
        """After ``pending`` landed: move a ``no_shard`` result in place, free the buffers."""
        if pending.ends_partial:
            self.drop_partial()
        if pending.outer_only:
            return  # it reduced the shard in place and used no collected gradients
        self._collector.clear(move_into=pending.no_shard_target)
