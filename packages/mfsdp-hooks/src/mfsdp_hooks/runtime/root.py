"""The root of a tree of units: discovery, streams, the final callback, step windows."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import nn

from mfsdp_collectives import CommStreams, naming_dead_peers
from mfsdp_hooks.config.grad_allocator import end_iteration, pools_memory
from mfsdp_hooks.config.unit_options import RootOptions
from mfsdp_hooks.grads.grad_reducer import GradReducer
from mfsdp_hooks.grads.grad_sync import GradSync
from mfsdp_hooks.runtime.execution_order import ExecutionOrder
from mfsdp_hooks.runtime.observe import log_units
from mfsdp_hooks.runtime.stale_optimizers import (
    guard_optimizers_on_compute_params,
    guard_optimizers_on_replaced_params,
)
from mfsdp_hooks.runtime.unit import FSDPUnit, unit_of, units_under
from mfsdp_hooks.weights.param_group import ParameterGroup


def unit_paths(module: nn.Module) -> list[tuple[str, FSDPUnit]]:
    """Each unit under ``module`` once, in module order, with its path under ``module``: that
    of its first module there (``""`` for ``module`` itself). The one name errors, logs,
    ``describe`` and quantized comms give a unit (``fully_shard([a, b])``'s ``unit.module``
    is a container outside the model: its members' paths name it)."""
    found: dict[int, tuple[str, FSDPUnit]] = {}
    for path, sub in module.named_modules():
        unit = unit_of(sub)
        if unit is not None:
            found.setdefault(id(unit), (path, unit))
    return list(found.values())


class FSDPRoot:
    """Coordinates the units of one model: created lazily by the first forward; the forward
    order lives in its ``order``, the gradient side in its ``grad_sync``. Every decision that
    issues a collective iterates ``self.units`` (module order) or the recorded execution
    order, both identical on every rank."""

    def __init__(self, root_unit: FSDPUnit) -> None:
        self.root_unit = root_unit
        self.units: list[FSDPUnit] = []
        # Each unit's path under the root module, so errors name parameters in full.
        self._unit_path: dict[int, str] = {}
        for path, unit in unit_paths(root_unit.module):
            self.units.append(unit)
            self._unit_path[id(unit)] = f"{path}." if path else ""
            unit.root = self
            for group in unit.groups:
                group.attach_root(self, self._unit_path[id(unit)])
        self._refuse_ignored_root_options()
        paths = [self._unit_path[id(unit)] for unit in self.units]
        log_units(root_unit.name, self.units, paths)  # INFO on mesh rank 0; names DEBUG events
        self.streams = CommStreams(root_unit.options.topology.device)
        self.order = ExecutionOrder(
            root_unit,
            lambda: self.root_options,
            numel_of=lambda unit: sum(g.layout.data_numel for g in unit.groups),
        )
        # The root's own state: True from the first pre-backward hook of an iteration until
        # its final callback has ended every unit's backward (a forward in between raises).
        self.in_backward = False
        # Finishing reductions as soon as they land would make a pool's free order vary,
        # and frees nothing from a pool.
        self.grad_sync = GradSync(
            lambda: self.root_options,
            reap_early=not any(pools_memory(u.options.grad_allocator) for u in self.units),
        )

    def _refuse_ignored_root_options(self) -> None:
        """Every ``fully_shard`` call takes the root-level options, but only the root's are
        read: one given to a non-root unit must equal the root's, or it would be ignored
        without a word (local and identical on every rank: no collective)."""
        for unit in self.units:
            for name, mine, roots in unit.options.root.differences(self.root_options):
                raise ValueError(
                    f"{name}={mine!r} was given to fully_shard({unit.name}), but {name} is a "
                    f"root-level option and the root fully_shard({self.root_unit.name}) has "
                    f"{name}={roots!r}: pass it to the root call (or the same value to both)"
                )

    @property
    def root_options(self) -> RootOptions:
        """The tree's root-level options: the root unit's, their one owner (its ``order``
        and ``grad_sync`` read them here; other units' are what their calls were given)."""
        return self.root_unit.options.root

    def set_root_options(self, options: RootOptions) -> None:
        """A root-level setter (``set_sync_model_each_microbatch``): from the next backward."""
        self.root_unit.options = dataclasses.replace(self.root_unit.options, root=options)

    @property
    def microbatch_count(self) -> int:
        """Backward passes since the gradients were last synced (the reference's)."""
        return self.grad_sync.microbatch_count

    @staticmethod
    def lazy_init(first: FSDPUnit) -> FSDPRoot:
        """The first unit to run forward is the root, as in FSDP2."""
        # Before the root exists: a refused optimizer leaves no root, so the next forward
        # checks again.
        units = units_under(first.module.modules())
        _refuse_units_awaiting_storage(units)
        starting = [group for unit in units for group in unit.groups]
        guard_optimizers_on_replaced_params(starting)
        return FSDPRoot(first)

    @property
    def groups(self) -> list[ParameterGroup]:
        return [g for unit in self.units for g in unit.groups]

    def _reducers(self, units: Sequence[FSDPUnit] | None = None) -> list[GradReducer]:
        return [
            g.reducer
            for u in (self.units if units is None else units)
            for g in u.groups
            if g.reducer is not None
        ]

    # ----------------------------------------------------------------- forward
    def pre_root_forward(self) -> None:
        if self.in_backward:
            raise RuntimeError(
                "forward of an FSDP root started while its previous backward is still running"
            )
        for group in self.groups:
            group.freshness.recheck_step_window()

    # ----------------------------------------------------------------- backward
    def begin_backward(self) -> None:
        if self.in_backward:
            return
        self.in_backward = True
        for group in self.groups:
            group.freshness.close_step_window(stepped=False)
        torch.autograd.Variable._execution_engine.queue_callback(self._final_callback)

    def _final_callback(self) -> None:
        try:
            for unit in self.units:
                if not unit.post_backward_done:
                    unit.post_backward()
            # Only ``no_sync`` micro-batches leave reductions in flight (``end_backward``).
            synced_units = [u for u in self.units if u.sync_flags.syncs_fully]
            waited = self.grad_sync.end_backward(
                self._reducers(synced_units), any_synced=bool(synced_units), streams=self.streams
            )
            self._settle_host_grads()
            if waited and self.root_options.report_nan_in_param_grad:
                self.check_grads_finite()
            if synced_units:
                self._open_step_windows()
            for unit in self.units:
                unit.end_backward()
            left = [
                u.name for u in self.units if u.is_unsharded and u.options.reshard_after_backward
            ]
            if left:
                raise RuntimeError(f"FSDP units left unsharded after backward: {left}")
            # Once, at the first backward: until now the model may have shown the root's
            # gathered weights (a forward whose backward never came) to a new optimizer.
            if not self.order.final:
                guard_optimizers_on_compute_params()
            self.order.finalize()
            for allocator in self._grad_allocators():
                end_iteration(allocator)
        finally:
            self.in_backward = False

    def reset_iteration(self) -> None:
        """``reset_iter_state`` after an exception: in-flight work done, units IDLE."""
        self.grad_sync.drain()
        for unit in self.units:
            unit.reset_iteration()
        self.in_backward = False

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
        replica hop) without waiting for them."""
        self.grad_sync.start(self._reducers(), self.streams)

    def finish_grad_sync(self) -> None:
        """Reduce whatever is still local (``no_sync`` windows) and wait for every reduction."""
        self.grad_sync.finish(self._reducers(), self.streams)
        self._settle_host_grads()
        if self.root_options.report_nan_in_param_grad:
            self.check_grads_finite()
        self._open_step_windows()

    def _settle_host_grads(self) -> None:
        """Host offload: the gradients reduced so far are on the host before anyone reads
        them (``config.offload``; a no-op for groups without it)."""
        for group in self.groups:
            group.settle_host_grads()

    def _open_step_windows(self) -> None:
        """Gradients are synced: until the next backward, any optimizer may step them."""
        for group in self.groups:
            group.freshness.open_step_window()

    def check_grads_finite(self) -> None:
        """Raise on every rank, naming each parameter whose reduced gradient is not finite.

        One all-reduce of the flags per group of ranks holding the gradient shards (units may
        shard over different groups), in unit order, which every rank shares.
        """
        checked = [(u, g) for u in self.units for g in u.groups if g.requires_grad]
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


def _refuse_units_awaiting_storage(units: Sequence[FSDPUnit]) -> None:
    """A forward before ``to_empty`` of units wrapped from meta parameters (they hold zeros,
    not weights; FSDP2's would fail on meta tensors): refused on every rank alike."""
    awaiting = [unit.name for unit in units if unit.awaiting_storage]
    if awaiting:
        raise RuntimeError(
            f"forward of a model whose FSDP units {awaiting} were sharded from parameters on the "
            "meta device and not given storage yet: call model.to_empty(device=...) and "
            "initialise the weights (e.g. model.init_weights() under torch.no_grad()) first, "
            "as with FSDP2"
        )


def root_of(module: nn.Module) -> FSDPRoot | None:
    unit = unit_of(module)
    root = unit.root if unit is not None else None
    return root if isinstance(root, FSDPRoot) else None
