"""The one owner of a root's gradient synchronisation, ``GradSync``: how far each unit's
backward reduces (``reach_of``, from the unit's ``SyncFlags`` and the root's options), the
reductions in flight (its ``ReductionQueue``), the micro-batches since the last sync and the
hop across HSDP replicas of what a ``no_sync`` micro-batch kept inside the shard group.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch

from mfsdp_collectives import CommStreams
from mfsdp_hooks.config.strategy import ShardingStrategy
from mfsdp_hooks.config.unit_options import RootOptions
from mfsdp_hooks.grads.grad_presence import agree_on_presence
from mfsdp_hooks.grads.grad_reducer import GradReducer
from mfsdp_hooks.grads.reduction_queue import ReductionQueue

__all__ = ["GradSync", "Reach", "SyncFlags"]


@dataclass
class SyncFlags:
    """One unit's gradient-sync flags, as FSDP2's setters leave them (``recurse`` sets them
    on every unit of a subtree)."""

    requires_gradient_sync: bool = True
    """False: this unit's backwards keep its gradients local (``no_sync``)."""
    requires_all_reduce: bool = True
    """HSDP: False reduces inside ``dp_shard`` only; the hop across replicas waits."""

    @property
    def syncs_fully(self) -> bool:
        return self.requires_gradient_sync and self.requires_all_reduce


class Reach(enum.Enum):
    """How far a unit's backward reduces its gradients, for a reducer of strategy ``s``.

    * ``FULL``: the unit syncs (``requires_gradient_sync`` and ``requires_all_reduce``):
      reduce everywhere, replicas included; this ends the unit's optimisation cycle.
    * ``SHARD_GROUP``: ZeRO-2/3 with ``requires_all_reduce`` False, or under ``no_sync``
      with ``reduce_scatter_in_no_sync``: reduce-scatter inside ``dp_shard``; the replica
      hop waits for a synced backward (with ``sync_model_each_microbatch``, happens now).
    * ``SKIP``: ZeRO-0/1 under either flag, or ZeRO-2/3 under ``no_sync`` (FSDP2's): the
      unsharded gradients stay local and add up until a synced backward reduces them.
    """

    SKIP = "skip"
    SHARD_GROUP = "shard_group"
    FULL = "full"


def reach_of(flags: SyncFlags, strategy: ShardingStrategy, options: RootOptions) -> Reach:
    """The one decision of how far a group's gradients go in this backward."""
    if flags.syncs_fully:
        return Reach.FULL
    if not strategy.shards_grads:
        return Reach.SKIP  # ZeRO-0/1: the gradient buffer is whole on every rank
    if not flags.requires_gradient_sync and not options.reduce_scatter_in_no_sync:
        return Reach.SKIP
    return Reach.SHARD_GROUP


class GradSync:
    """Reductions in flight, when a backward reduces and waits, and the replica hop."""

    def __init__(self, root_options: Callable[[], RootOptions], *, reap_early: bool) -> None:
        self._root_options = root_options  # read where they live: a setter counts at once
        options = root_options()
        self.reductions = ReductionQueue(
            options.max_inflight_reductions,
            overlap=options.overlap_grad_reduce,
            reap_early=reap_early,
        )
        # The reference's ``microbatch_count``: backward passes since ``finish`` (which the
        # optimizer step calls); always 0 when every micro-batch syncs.
        self.microbatch_count = 0
        # Reducers launched since the gradients were last agreed on, in launch order (the
        # same on every rank): ``grad_presence`` gives None to what no rank had a gradient for.
        self._launched: dict[int, GradReducer] = {}

    @property
    def options(self) -> RootOptions:
        return self._root_options()

    def _queue_reduction(
        self, reducer: GradReducer, streams: CommStreams | None, *, ends_cycle: bool
    ) -> None:
        self._launched.setdefault(id(reducer), reducer)
        self.reductions.enqueue(reducer, streams, ends_cycle=ends_cycle)

    def _drain_and_agree(self) -> None:
        """Wait for every reduction, then settle which parameters got no gradient anywhere."""
        self.reductions.drain()
        launched, self._launched = list(self._launched.values()), {}
        agree_on_presence(launched)

    # ------------------------------------------------------------ during a backward
    def accumulate(self, reducer: GradReducer, index: int, grad: torch.Tensor) -> bool:
        """Hand one parameter's gradient to its reducer; True once the group has them all.
        Landed reductions are finished first, freeing their gradients early, and this
        reducer's own one still in flight is settled (its buffer is about to be reused)."""
        self.reductions.reap_landed()
        self.reductions.settle(reducer)
        return reducer.accumulate(index, grad)

    def reduce_after_backward(
        self, reducer: GradReducer, flags: SyncFlags, streams: CommStreams | None
    ) -> None:
        """A unit's backward is done: reduce ``reducer``'s gradients as far as its flags say."""
        reach = reach_of(flags, reducer.strategy, self.options)
        if reach is Reach.FULL:
            self._queue_reduction(reducer, streams, ends_cycle=True)
        elif reach is Reach.SHARD_GROUP:
            ends = self.options.sync_model_each_microbatch and flags.requires_all_reduce
            self._queue_reduction(reducer, streams, ends_cycle=ends)

    def end_backward(
        self, synced: Iterable[GradReducer], *, any_synced: bool, streams: CommStreams | None
    ) -> bool:
        """The root's final callback: ``synced`` are the reducers of fully synced units.

        Their shards that still hold parts kept inside the shard group cross the replicas
        now; the backward waits for every reduction when any unit synced (an optimizer the
        engine never sees may read the gradients next) or every micro-batch syncs. Returns
        whether it waited."""
        for reducer in synced:
            if reducer.needs_outer_sync:
                self._queue_reduction(reducer, streams, ends_cycle=True)
        each = self.options.sync_model_each_microbatch
        if any_synced or each:
            self._drain_and_agree()
        self.microbatch_count = 0 if each else self.microbatch_count + 1
        return any_synced or each

    # ------------------------------------------------------------ outside a backward
    def start(self, reducers: Iterable[GradReducer], streams: CommStreams | None) -> None:
        """Launch the reductions of whatever is still local without waiting for them."""
        reducers = list(reducers)
        for reducer in reducers:
            if reducer.has_grads and not self.reductions.in_flight(reducer):
                self._queue_reduction(reducer, streams, ends_cycle=True)
        for reducer in reducers:
            if reducer.needs_outer_sync:
                self._queue_reduction(reducer, streams, ends_cycle=True)

    def finish(self, reducers: Iterable[GradReducer], streams: CommStreams | None) -> None:
        """Reduce whatever is still local and wait for every reduction."""
        self.start(reducers, streams)
        self._drain_and_agree()
        self.microbatch_count = 0

    def drain(self) -> None:
        """Wait for every reduction in flight (``reset_iter_state``: no agreement, which a rank
        that did not fail would not join; the gradients stay as reduced)."""
        self.reductions.drain()
        for reducer in self._launched.values():
            reducer.presence = None
        self._launched = {}
