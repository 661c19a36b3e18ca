"""How one parameter group's gradients travel: one reduce plan per topology, chosen once.

A ``GradReducer`` hands what its collector gathered to its plan, which issues the
collective and says what to free once it landed (a ``Launched``). The two plans that cross
the replicas keep how far their shard got (``ReplicaSync``). A plan checks its groups once,
when built (its ``Route``s): the buffers it reduces are laid out for them, so its reductions
check nothing again.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from mfsdp_collectives import CommHandle, CommStreams, FSDPTopology, ReduceSpec, Route
from mfsdp_hooks.config.comm_hooks import CommHooks
from mfsdp_hooks.config.offload import GradLanding
from mfsdp_hooks.config.strategy import ShardingStrategy
from mfsdp_hooks.grads.grad_collector import GradCollector
from mfsdp_hooks.grads.grad_shard import GradShard

__all__ = [
    "FlatPlan",
    "HFSDPPlan",
    "HSDPPlan",
    "Launched",
    "NoShardPlan",
    "ReduceInputs",
    "ReducePlan",
    "ReplicaSync",
    "choose_plan",
]


@dataclass(frozen=True)
class Launched:
    """A reduction a plan issued, and what to do once it landed (free what it read)."""

    handle: CommHandle
    release: Callable[[], None]


class ReplicaSync(enum.Enum):
    """How far a gradient shard is reduced across the HSDP replicas in this cycle.

    ``EMPTY`` (nothing in it) -> ``INNER_ONLY`` (a ``no_sync`` micro-batch's reduction stayed
    in the shard group) -> ``COMPLETE`` (the reduction that ends the cycle took the whole
    shard across the replicas). A reduction from ``EMPTY`` or ``COMPLETE`` that ends the cycle
    reduces only its own part across them; a fresh shard (``zero_grad``) starts ``EMPTY``.
    Under HFSDP the parts kept inside the shard group live in the plan's partial buffer, not
    in the shard: ``INNER_ONLY`` means the partial holds them, and ``zero_main_grads`` drops
    them with the gradients.
    """

    EMPTY = "empty"
    INNER_ONLY = "inner_only"
    COMPLETE = "complete"


@dataclass(frozen=True)
class ReduceInputs:
    """What every plan reads: the collector, the shard it reduces into (and the parameters
    whose ``.grad`` views it), the topology."""

    collector: GradCollector
    grads: GradShard
    params: tuple[nn.Parameter, ...]
    topology: FSDPTopology
    landing: GradLanding | None = None
    """Host offload: the gradients live on the host, the reduction writes a device staging
    buffer that ``landing`` copies home once it landed."""

    def target(self) -> tuple[torch.Tensor, bool]:
        """The flat gradients the reduction writes, and whether it adds to them."""
        target, accumulate = self.grads.prepare(self.params)
        if self.landing is None:
            return target, accumulate
        return self.landing.stage(target, accumulate)


class ReducePlan:
    """One way of reducing a group's collected gradients into its ``GradShard``."""

    def __init__(self, inputs: ReduceInputs) -> None:
        self._in = inputs
        self._collector = inputs.collector
        topology = inputs.topology
        self._route = Route(topology.shard_group, topology.host_transport)
        outer = topology.outer_group
        self._outer = None if outer is None else Route(outer, topology.outer_transport)

    @property
    def needs_outer_sync(self) -> bool:
        """The shard holds parts not yet reduced across the HSDP replicas."""
        return False

    def issue_collectives(
        self, spec: ReduceSpec, streams: CommStreams | None, *, ends_cycle: bool, hooks: CommHooks
    ) -> Launched:
        """Issue the reduction; ``hooks``: the unit's custom reduce-scatter and all-reduce
        hook (``check_comm_hooks`` lets only the flat and HSDP plans have them)."""
        raise NotImplementedError

    def drop_partial(self) -> None:
        """Forget the parts kept inside the shard group (the gradients were zeroed)."""


class FlatPlan(ReducePlan):
    """A reduce-scatter in the shard group into this rank's shard (plain FSDP; an expert
    group is the same plan over its expert-data-parallel topology)."""

    def issue_collectives(
        self, spec: ReduceSpec, streams: CommStreams | None, *, ends_cycle: bool, hooks: CommHooks
    ) -> Launched:
        target, accumulate = self._in.target()
        handle = self._route.reduce_scatter_into(
            self._collector.collected(),
            target,
            spec=spec,
            accumulate=accumulate,
            stream=streams,
            comm=hooks.reduce_scatter,
            after_reduce=hooks.after_reduce(),
        )
        return Launched(handle, self._collector.clear)


class NoShardPlan(ReducePlan):
    """``no_shard``: an all-reduce of the whole buffer (with HSDP across ``dp_outer`` too;
    never held: no transport reads it in place), moved into the gradients once it landed."""

    def issue_collectives(
        self, spec: ReduceSpec, streams: CommStreams | None, *, ends_cycle: bool, hooks: CommHooks
    ) -> Launched:
        target, accumulate = self._in.target()
        buffer = self._collector.collected()
        assert isinstance(buffer, torch.Tensor)
        handle = self._route.all_reduce_(buffer, spec=spec, stream=streams, outer=self._outer)
        return Launched(handle, lambda: self._collector.clear(move_into=(target, accumulate)))


class _AcrossReplicas(ReducePlan):
    """A plan whose shard crosses the replicas once per cycle (``ReplicaSync``)."""

    def __init__(self, inputs: ReduceInputs) -> None:
        super().__init__(inputs)
        assert self._outer is not None, f"{type(self).__name__} without an outer group"
        self._outer_route: Route = self._outer
        self._state = ReplicaSync.EMPTY

    @property
    def needs_outer_sync(self) -> bool:
        return self._state is ReplicaSync.INNER_ONLY

    def drop_partial(self) -> None:
        if self._state is ReplicaSync.INNER_ONLY:
            self._state = ReplicaSync.EMPTY


class HSDPPlan(_AcrossReplicas):
    """A reduction that does not end the optimisation cycle (a ``no_sync`` micro-batch) stays
    inside the shard group; the one that ends it reduces the whole shard across the
    replicas, so each replica's accumulated gradient crosses them once per cycle."""

    def issue_collectives(
        self, spec: ReduceSpec, streams: CommStreams | None, *, ends_cycle: bool, hooks: CommHooks
    ) -> Launched:
        target, accumulate = self._in.target()
        if not accumulate:
            self._state = ReplicaSync.EMPTY
        if not self._collector.has_grads and self._state is ReplicaSync.INNER_ONLY:
            # finish_grad_sync: only what no_sync kept is left, already in the shard
            outer_spec = ReduceSpec(average=spec.average, sum_only=spec.sum_only)
            handle = self._outer_route.all_reduce_(
                target, spec=outer_spec, stream=streams, after_reduce=hooks.after_reduce()
            )
            self._state = ReplicaSync.COMPLETE
            return Launched(handle, lambda: None)  # it read no collected gradients
        state = self._state
        defer = not ends_cycle and state is not ReplicaSync.COMPLETE
        handle = self._route.hsdp_reduce_scatter_into(
            self._collector.collected(),
            target,
            None if defer else self._outer_route,
            spec=spec,
            accumulate=accumulate,
            stream=streams,
            outer_reduces_output=state is ReplicaSync.INNER_ONLY,
            comm=hooks.reduce_scatter,
            # FSDP2 calls it once the gradient crossed the replicas, not on a partial.
            after_reduce=None if defer else hooks.after_reduce(),
        )
        self._state = ReplicaSync.INNER_ONLY if defer else ReplicaSync.COMPLETE
        return Launched(handle, self._collector.clear)


class HFSDPPlan(_AcrossReplicas):
    """Optimizer state sharded across ``dp_outer`` too: a ``no_sync`` micro-batch's reduction
    stays in the shard group, summed into a ``partial`` compute-shard buffer; the reduction
    that ends the cycle reduce-scatters the partial across ``dp_outer`` into the sub-shard."""

    def __init__(self, inputs: ReduceInputs, *, partial_numel: int) -> None:
        super().__init__(inputs)
        self._partial_numel = partial_numel
        self._partial: torch.Tensor | None = None

    def _partial_buffer(self) -> torch.Tensor:
        """The cycle's compute-shard gradient, in the gradients' dtype (micro-batches add
        into it); not from the allocator, whose buffers live for one reduction."""
        if self._partial is None:
            self._partial = self._in.grads.new_flat(self._partial_numel)
        return self._partial

    def drop_partial(self) -> None:
        self._partial = None
        super().drop_partial()

    def _release_all(self) -> None:
        self.drop_partial()
        self._collector.clear()

    def issue_collectives(
        self, spec: ReduceSpec, streams: CommStreams | None, *, ends_cycle: bool, hooks: CommHooks
    ) -> Launched:
        kept = self._state is ReplicaSync.INNER_ONLY
        if not ends_cycle:
            handle = self._route.reduce_scatter_into(
                self._collector.collected(),
                self._partial_buffer(),
                spec=spec,
                accumulate=kept,
                stream=streams,
            )
            self._state = ReplicaSync.INNER_ONLY
            return Launched(handle, self._collector.clear)
        target, accumulate = self._in.target()
        self._state = ReplicaSync.COMPLETE
        if not self._collector.has_grads:  # finish_grad_sync: only what no_sync kept is left
            handle = self._outer_route.reduce_scatter_into(
                self._partial_buffer(),
                target,
                spec=dataclasses.replace(spec, post_scale=None),
                accumulate=accumulate,
                stream=streams,
            )
            return Launched(handle, self.drop_partial)
        handle = self._route.hfsdp_reduce_scatter_into(
            self._collector.collected(),
            target,
            self._outer_route,
            partial=self._partial_buffer(),
            partial_accumulate=kept,
            spec=spec,
            accumulate=accumulate,
            stream=streams,
        )
        return Launched(handle, self._release_all)


def choose_plan(
    inputs: ReduceInputs, *, strategy: ShardingStrategy, partial_numel: int
) -> ReducePlan:
    """The plan for ``inputs.topology`` and ``strategy`` (``partial_numel``: the compute
    shard's size, HFSDP's partial buffer)."""
    topology = inputs.topology
    if topology.shards_optimizer_across_outer:
        return HFSDPPlan(inputs, partial_numel=partial_numel)
    if strategy == ShardingStrategy.NO_SHARD:
        return NoShardPlan(inputs)
    if topology.outer_group is not None:
        return HSDPPlan(inputs)
    return FlatPlan(inputs)
