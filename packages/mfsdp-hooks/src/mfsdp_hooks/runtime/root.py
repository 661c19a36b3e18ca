"""State shared by all units under one root module: order, prefetch, pending reductions."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from mfsdp_collectives import CommStreams, naming_dead_peers
from mfsdp_hooks.config.grad_allocator import end_iteration, pools_memory
from mfsdp_hooks.config.unit_options import ROOT_LEVEL_OPTIONS, UnitOptions
from mfsdp_hooks.grads.reduction_queue import ReductionQueue
from mfsdp_hooks.runtime.observe import log_units
from mfsdp_hooks.runtime.stale_optimizers import guard_optimizers_on_replaced_params
from mfsdp_hooks.runtime.unit import FSDPUnit, unit_of
from mfsdp_hooks.weights.param_group import ParameterGroup


class FSDPRoot:
    """Coordinates the units of one model: created lazily by the first forward.

    Every decision that issues a collective iterates ``self.units`` (module order) or the
    recorded execution order, both identical on every rank.
    """

    def __init__(self, root_unit: FSDPUnit) -> None:
        self.root_unit = root_unit
        self.units: list[FSDPUnit] = []
        # Each unit's path under the root module, so errors name parameters in full.
        self._unit_path: dict[int, str] = {}
        for path, module in root_unit.module.named_modules():
            unit = unit_of(module)
            if unit is not None and id(unit) not in self._unit_path:
                self.units.append(unit)
                self._unit_path[id(unit)] = f"{path}." if path else ""
                unit.root = self
                for group in unit.groups:
                    group.root = self
        self._refuse_ignored_root_options()
        paths = [self._unit_path[id(unit)] for unit in self.units]
        log_units(root_unit.name, self.units, paths)  # INFO on rank 0; names DEBUG events
        self.streams = CommStreams(self.options.topology.device)
        self.forward_order: list[FSDPUnit] = []
        self.order_final = False
        self._next: dict[int, list[FSDPUnit]] = {}
        self._previous: dict[int, list[FSDPUnit]] = {}
        # The root's own state: True from the first pre-backward hook of an iteration until
        # its final callback has ended every unit's backward (a forward in between raises).
        self.in_backward = False
        # The reference's ``microbatch_count``: backward passes since ``finish_grad_sync``
        # (which the optimizer step calls); always 0 when every micro-batch syncs.
        self.microbatch_count = 0
        # Finishing reductions as soon as they land would make a pool's free order vary,
        # and frees nothing from a pool.
        self.reductions = ReductionQueue(
            self.options.max_inflight_reductions,
            overlap=self.options.overlap_grad_reduce,
            reap_early=not any(pools_memory(u.options.grad_allocator) for u in self.units),
        )

    def _refuse_ignored_root_options(self) -> None:
        """A root-level option given to a non-root unit must equal the root's, or it would be
        ignored without a word (local and identical on every rank: no collective)."""
        for unit in self.units:
            for name in ROOT_LEVEL_OPTIONS:
                mine, roots = getattr(unit.options, name), getattr(self.options, name)
                if mine != roots:
                    raise ValueError(
                        f"{name}={mine!r} was given to fully_shard({unit.name}), but {name} is a "
                        f"root-level option and the root fully_shard({self.root_unit.name}) has "
                        f"{name}={roots!r}: pass it to the root call (or the same value to both)"
                    )

    @property
    def options(self) -> UnitOptions:
        """The root unit's options, read afresh: runtime setters replace them."""
        return self.root_unit.options

    @staticmethod
    def lazy_init(first: FSDPUnit) -> FSDPRoot:
        """The first unit to run forward is the root, as in FSDP2."""
        guard_optimizers_on_replaced_params()
        return FSDPRoot(first)

    @property
    def groups(self) -> list[ParameterGroup]:
        return [g for unit in self.units for g in unit.groups]

    # ----------------------------------------------------------------- forward order
    def pre_root_forward(self) -> None:
        if self.in_backward:
            raise RuntimeError(
                "forward of an FSDP root started while its previous backward is still running"
            )
        for group in self.groups:
            group.freshness.recheck_step_window()

    def record_forward(self, unit: FSDPUnit) -> None:
        if not self.order_final and all(u is not unit for u in self.forward_order):
            self.forward_order.append(unit)

    def _finalize_order(self) -> None:
        """Fix the prefetch targets once, from the order the first iteration ran in."""
        order, depth = self.forward_order, self.options.prefetch_depth
        self._next = {id(u): order[i + 1 : i + 1 + depth] for i, u in enumerate(order)}
        self._previous = {
            id(u): [p for p in reversed(order[max(i - depth, 0) : i]) if p is not self.root_unit]
            for i, u in enumerate(order)
        }
        self.order_final = True

    def forward_prefetch_targets(self, unit: FSDPUnit) -> list[FSDPUnit]:
        if unit.forward_prefetch is not None:
            return unit.forward_prefetch
        return self._next.get(id(unit), []) if self.order_final else []

    def backward_prefetch_targets(self, unit: FSDPUnit) -> list[FSDPUnit]:
        if unit.backward_prefetch is not None:
            return unit.backward_prefetch
        return self._previous.get(id(unit), []) if self.order_final else []

    # ----------------------------------------------------------------- backward
    def begin_backward(self) -> None:
        if self.in_backward:
            return
        self.in_backward = True
        for group in self.groups:
            group.freshness.close_step_window(stepped=False)
        torch.autograd.Variable._execution_engine.queue_callback(self._final_callback)

    @property
    def syncs_fully(self) -> bool:
        """This backward's gradients are to be reduced everywhere, replicas included
        (outside ``no_sync`` and not under ``set_requires_all_reduce(False)``)."""
        return self.root_unit.requires_gradient_sync and self.root_unit.requires_all_reduce

    def should_reduce(self, group: ParameterGroup) -> bool:
        return group.strategy.shards_grads or self.syncs_fully

    def settle_reduction(self, group: ParameterGroup) -> None:
        if group.reducer is not None:
            self.reductions.settle(group.reducer)

    def reduce(self, group: ParameterGroup) -> None:
        """Reduce what a unit's backward collected; outside ``no_sync`` (or when every
        micro-batch syncs) this ends the optimisation cycle."""
        ends = self.syncs_fully or (
            self.options.sync_model_each_microbatch and self.root_unit.requires_all_reduce
        )
        self._launch(group, ends_cycle=ends)

    def _launch(self, group: ParameterGroup, *, ends_cycle: bool) -> None:
        assert group.reducer is not None, "frozen parameter groups have no gradients to reduce"
        self.reductions.launch(group.reducer, self.streams, ends_cycle=ends_cycle)

    def reap_finished_reductions(self) -> None:
        self.reductions.reap_landed()

    def wait_reductions(self) -> None:
        self.reductions.drain()

    def _final_callback(self) -> None:
        try:
            for unit in self.units:
                if not unit.post_backward_done:
                    unit.post_backward()
            # A backward outside ``no_sync`` ends an optimisation cycle: an optimizer the
            # engine never sees may read the gradients next, so they must be final. Only
            # ``no_sync`` micro-batches leave reductions in flight (unless every micro-batch
            # syncs), overlapping them with the next micro-batch.
            synced = self.syncs_fully
            if synced:
                self._sync_across_replicas()
            if synced or self.options.sync_model_each_microbatch:
                self.wait_reductions()
                if self.options.report_nan_in_param_grad:
                    self.check_grads_finite()
            if synced:
                self._open_step_windows()
            each = self.options.sync_model_each_microbatch
            self.microbatch_count = 0 if each else self.microbatch_count + 1
            for unit in self.units:
                unit.end_backward()
            left = [
                u.name for u in self.units if u.is_unsharded and u.options.reshard_after_backward
            ]
            if left:
                raise RuntimeError(f"FSDP units left unsharded after backward: {left}")
            if not self.order_final:
                self._finalize_order()
            for allocator in self._grad_allocators():
                end_iteration(allocator)
        finally:
            self.in_backward = False

    def reset_iteration(self) -> None:
        """``reset_iter_state`` after an exception: in-flight work done, units IDLE."""
        self.wait_reductions()
        for unit in self.units:
            unit.reset_iteration()
        self.in_backward = False

    def _sync_across_replicas(self) -> None:
        """HSDP: shards that still hold ``no_sync`` parts (their unit reduced nothing in this
        last micro-batch) are all-reduced across the replicas now."""
        for group in self.groups:
            if group.reducer is not None and group.reducer.needs_outer_sync:
                self._launch(group, ends_cycle=True)

    def _grad_allocators(self) -> list[object]:
        """Each distinct gradient-buffer allocator of the tree once (units may share one)."""
        found: dict[int, object] = {}
        for unit in self.units:
            allocator = unit.options.grad_allocator
            if allocator is not None:
                found.setdefault(id(allocator), allocator)
        return list(found.values())

    def start_grad_sync(self) -> None:
        """Launch the reductions of whatever is still local (``no_sync`` windows, HSDP's
        replica all-reduce) without waiting for them."""
        for group in self.groups:
            reducer = group.reducer
            if reducer is None:
                continue
            if reducer.has_grads and not self.reductions.in_flight(reducer):
                self._launch(group, ends_cycle=True)
        self._sync_across_replicas()

    def finish_grad_sync(self) -> None:
        """Reduce whatever is still local (``no_sync`` windows) and wait for every reduction."""
        self.start_grad_sync()
        self.wait_reductions()
        if self.options.report_nan_in_param_grad:
            self.check_grads_finite()
        self._open_step_windows()
        self.microbatch_count = 0

    def _open_step_windows(self) -> None:
        """Gradients are synced: until the next backward, any optimizer may step them."""
        for group in self.groups:
            group.freshness.open_step_window()

    def check_grads_finite(self) -> None:
        """Raise on every rank, naming each parameter whose reduced gradient is not finite.

        One all-reduce of the flags over the ranks that hold the gradient shards (the shard
        group; under HFSDP both DP levels): the rank holding a bad shard tells all.
        """
        checked = [(u, g) for u in self.units for g in u.groups if g.requires_grad]
        # One all-reduce per group (units may shard over different groups), in unit order,
        # which every rank shares.
        by_group: dict[int, list[tuple[FSDPUnit, ParameterGroup]]] = {}
        for unit, group in checked:
            by_group.setdefault(id(group.topology.optim_group), []).append((unit, group))
        bad: list[str] = []
        for members in by_group.values():
            flags = torch.cat([g.grad_nan_flags() for _, g in members])
            holders = members[0][1].topology.optim_group
            with naming_dead_peers("the NaN/Inf gradient check", holders):
                dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=holders)
            names = [self._unit_path[id(u)] + name for u, g in members for name in g.names]
            bad += [name for name, flag in zip(names, flags.tolist(), strict=True) if flag]
        if bad:
            raise RuntimeError(
                f"NaN or Inf in the reduced gradient of {bad} (report_nan_in_param_grad=True): "
                "no weight was updated; check the loss scale and the inputs of the step"
            )


def root_of(module: nn.Module) -> FSDPRoot | None:
    unit = unit_of(module)
    root = unit.root if unit is not None else None
    return root if isinstance(root, FSDPRoot) else None
