"""An FSDP unit: one wrapped module, its parameter groups and its lifecycle hooks."""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Sequence
from typing import Any, TypeVar

import torch
from torch import nn

from mfsdp_collectives import CommStreams, PostForwardGroup
from mfsdp_hooks.config.comm_hooks import CommHooks
from mfsdp_hooks.config.unit_options import UnitOptions
from mfsdp_hooks.dtensor.load_rows import take_own_rows
from mfsdp_hooks.dtensor.tensor_parallel import grad_local
from mfsdp_hooks.grads.grad_sync import SyncFlags
from mfsdp_hooks.runtime import timeline
from mfsdp_hooks.runtime.backward_prefetch import BackwardPrefetch
from mfsdp_hooks.runtime.compute_region import (
    ComputeRegion,
    cast_inputs,
    cast_outputs,
    forward_policy,
    installed_params,
)
from mfsdp_hooks.runtime.gather_ahead import gather_ahead
from mfsdp_hooks.runtime.input_grad_trigger import (
    register_pre_backward,
    route_inputs_through_trigger,
)
from mfsdp_hooks.runtime.member_forwards import MemberForwards
from mfsdp_hooks.runtime.observe import describe_unit, log_event
from mfsdp_hooks.runtime.root_protocol import UnitRoot
from mfsdp_hooks.runtime.slots import UNIT_ATTR, SlotMap, install_params, unit_named_parameters
from mfsdp_hooks.runtime.training_state import TrainingState, in_backward_pass
from mfsdp_hooks.runtime.unit_groups import build_groups
from mfsdp_hooks.weights.lookup import (
    register_group_params,
    replaced_by_unit,
    tied_to_other_unit,
)
from mfsdp_hooks.weights.param_group import ParameterGroup, Waitable


def unit_of(module: nn.Module) -> FSDPUnit | None:
    unit = module.__dict__.get(UNIT_ATTR)
    return unit if isinstance(unit, FSDPUnit) else None


def units_under(modules: Iterable[nn.Module]) -> list[FSDPUnit]:
    """The distinct units of ``modules``, in order: a unit over several modules
    (``fully_shard([a, b])``) is listed once."""
    found: dict[int, FSDPUnit] = {}
    for module in modules:
        unit = unit_of(module)
        if unit is not None:
            found.setdefault(id(unit), unit)
    return list(found.values())


_Hook = TypeVar("_Hook", bound=Callable[..., Any])


def untraced(hook: _Hook) -> _Hook:
    """``hook`` run as written under ``torch.compile``, as FSDP2's hooks are: it gathers,
    swaps parameters and issues collectives, work no graph may hold or reorder. Dynamo
    breaks the graph around it and compiles the module's forward between the hooks."""
    disabled: _Hook = torch.compiler.disable(  # type: ignore[no-untyped-call]
        hook, recursive=True, reason="FSDP unit hooks"
    )
    return disabled


def _hook_members(unit: FSDPUnit) -> None:
    """The unit's forward hooks on each member module, and the marks others read."""
    for member in unit.forwards.members:
        member.__dict__[UNIT_ATTR] = unit
        # What torch's fully_shard sets on the modules it manages: Hugging Face's generate()
        # reads the first to keep ranks in step (synced_gpus) when they stop apart; dynamo
        # reads both to trace the modules with their parameters as graph inputs (we swap
        # sharded and gathered ones in as FSDP2 does). The first alone is FSDP1 without
        # use_orig_params to dynamo, which then compiles nothing of the module.
        for managed in member.modules():
            managed.__dict__["_is_fsdp_managed_module"] = True
            managed.__dict__["_fsdp_use_orig_params"] = True
        member.register_forward_pre_hook(untraced(unit.pre_forward), prepend=True, with_kwargs=True)
        member.register_forward_hook(untraced(unit.post_forward), always_call=False)
        # Full tensors and torch-sharded DTensors (set_model_state_dict) become our rows.
        member.register_load_state_dict_pre_hook(_take_own_rows)  # type: ignore[no-untyped-call]
        member.register_load_state_dict_post_hook(  # type: ignore[no-untyped-call]
            functools.partial(_after_load, unit)
        )


def _take_own_rows(member: nn.Module, state_dict: dict[str, Any], prefix: str, *_: Any) -> None:
    """Convert only the values of the unit's own parameters: a nested unit's hook (torch runs
    every module's) converts its own."""
    take_own_rows(state_dict, unit_named_parameters(member, prefix))


def _after_load(unit: FSDPUnit, module: nn.Module, incompatible: Any) -> None:
    """``load_state_dict`` wrote the optimizer-facing weights in place (torch's ``copy_``):
    the compute weights are rebuilt from them at the next unshard, under every strategy."""
    for group in unit.groups:
        group.mark_weights_dirty()


def _refuse_autograd_in_cast_region(unit: FSDPUnit, region: ComputeRegion) -> None:
    cast = [g for g in unit.groups if region.casts(g)]
    if cast:
        raise RuntimeError(
            f"unit {unit.name}: a forward with autograd on inside mixed_precision_context("
            f"param_dtype={region.compute_dtype(cast[0])}), whose cast weights take no "
            "gradients: run it under torch.no_grad() (evaluation, generation), or keep the "
            "model's param_dtype in the region"
        )


def _issue_gathers(unit: FSDPUnit, pending: list[Waitable], streams: CommStreams | None) -> None:
    """Start ``unit``'s all-gathers that are needed, adding each to ``pending`` as it is
    issued (a timeline sees the issue)."""
    recorder = timeline.ACTIVE
    span = None if recorder is None else recorder.gather_issue(unit, streams)
    before = len(pending)
    for group in unit.groups:
        handle = group.unshard(streams)
        if handle is not None:
            pending.append(handle)
    if span is not None:
        span.end(keep=len(pending) > before)  # nothing issued: its time was the caller's


def _await_gathers(unit: FSDPUnit) -> None:
    """Wait for ``unit``'s all-gathers in flight (its pending list, emptied): the part of a
    gather the compute thread pays (a timeline sees the wait)."""
    handles, unit._pending_unshard = unit._pending_unshard, []
    if not handles:
        return
    recorder = timeline.ACTIVE
    span = None if recorder is None else recorder.gather_wait(unit)
    for handle in handles:
        handle.wait()
    if span is not None:
        span.end()


def _refuse_params_of_other_units(unit: str, slots: SlotMap) -> None:
    for param, name, _ in slots.values():
        if (owner := replaced_by_unit(param)) is not None:
            raise tied_to_other_unit(name, unit, owner)


def _register_grad_hooks(
    groups: Sequence[ParameterGroup],
    on_grad_ready: Callable[[ParameterGroup, int, torch.Tensor], None],
) -> None:
    for group in groups:
        register_group_params(group)
        for index, param in enumerate(group.unsharded_params):
            if group.requires_grad:
                param.register_post_accumulate_grad_hook(  # type: ignore[no-untyped-call]
                    functools.partial(on_grad_ready, group, index)
                )


def _all_received(groups: Sequence[ParameterGroup]) -> bool:
    return all(g.reducer is not None and g.reducer.all_received for g in groups)


def _gradient_after_backward(unit: str, param: str) -> RuntimeError:
    return RuntimeError(
        f"FSDP unit {unit}: the gradient of {param!r} arrived after the unit's backward ended "
        "(the gradient of its inputs was already computed); a parameter whose gradient does "
        "not flow through the unit's inputs cannot be reduced with the unit's others"
    )


def _outside_root_forward(unit: FSDPUnit) -> bool:
    """A member called by itself after its root's forward ended (not in recompute)."""
    root = unit.root
    return not (root is None or root.root_unit is unit or in_backward_pass()) and (
        root.root_unit.state is not TrainingState.FORWARD
    )


class FSDPUnit:
    """Drives unshard → forward → reshard → backward → reduce for one module."""

    def __init__(
        self,
        module: nn.Module,
        options: UnitOptions,
        make_root: Callable[[FSDPUnit], object],
        slots: SlotMap,
        members: Sequence[nn.Module] = (),
    ) -> None:
        """``slots``: ``collect_slots(module)``, which ``fully_shard`` already checked.
        ``members``: for ``fully_shard([a, b])``, the modules whose forwards drive the unit
        (``module`` is then a container of them outside the user's tree)."""
        self.module = module
        self.forwards = MemberForwards(members or (module,))
        self._make_root = make_root  # at the first forward; it sets every unit's ``root``
        self.options = options
        self.name = type(module).__name__
        self.state = TrainingState.IDLE
        self.root: UnitRoot[FSDPUnit] | None = None
        self.forward_prefetch: list[FSDPUnit] | None = None
        self.backward_prefetch: list[FSDPUnit] | None = None
        self._pending_unshard: list[Waitable] = []
        self._inputs_trigger_armed = False  # this forward's inputs carry input_grad_trigger
        self.sync_flags = SyncFlags()  # FSDP2's set_requires_gradient_sync/_all_reduce
        self.comm_hooks = CommHooks()  # FSDP2's comm hooks (given out by set_comm_hooks)
        self._took_part = False  # its forward ran (with grad) since its backward ended
        # mixed_precision_context (set by compute_region), and whether its casts are in use
        self.region: ComputeRegion | None = None
        self._region_params_installed = False
        self.awaiting_storage = False  # wrapped from meta, until to_empty (module_conversion)
        _refuse_params_of_other_units(self.name, slots)
        self.groups, self._group_slots = build_groups(self.name, slots, options)
        trainable = sum(g.layout.data_numel for g in self.groups if g.requires_grad)
        self._prefetch = BackwardPrefetch(trainable)
        _register_grad_hooks(self.groups, self._on_grad_ready)
        self._swap(use_unsharded=False)
        module.__dict__[UNIT_ATTR] = self
        _hook_members(self)

    def __repr__(self) -> str:
        return describe_unit(self)

    # ----------------------------------------------------------------- state
    def _move_to(self, state: TrainingState) -> None:
        """The one place the unit changes state (``TrainingState`` lists the legal moves)."""
        self.state.check_move(state, self.name)
        self.state = state

    @property
    def post_backward_done(self) -> bool:
        """Its backward is over for this iteration (until the root's final callback)."""
        return self.state is TrainingState.POST_BACKWARD

    # ----------------------------------------------------------------- parameter swap
    def _swap(self, use_unsharded: bool) -> None:
        region = self.region if use_unsharded else None
        for group, group_slots in zip(self.groups, self._group_slots, strict=True):
            install_params(installed_params(group, use_unsharded, region), group_slots)
        self._region_params_installed = region is not None

    def reinstall_params(self) -> None:
        if self._region_params_installed:  # after a region: the gathered weights, not casts
            self._swap(use_unsharded=True)

    @property
    def in_step(self) -> bool:  # a forward, backward or a forward's pending backward
        return self.state is not TrainingState.IDLE or self._took_part

    @property
    def is_unsharded(self) -> bool:
        return any(g.is_unsharded for g in self.groups if g.model.sharded)

    # ----------------------------------------------------------------- unshard / reshard
    def unshard_async(self) -> None:
        """Issue this unit's all-gathers (if needed) without waiting for them."""
        streams = self.root.streams if self.root is not None else None
        _issue_gathers(self, self._pending_unshard, streams)

    def wait_unshard(self) -> None:
        _await_gathers(self)
        self._swap(use_unsharded=True)

    def request_unshard(self) -> None:
        """Issue a user's unshard: re-install weights a bare optimizer may have stepped."""
        for group in self.groups:
            group.freshness.recheck_step_window()
        self.unshard_async()

    def unshard(self) -> None:
        """Make the unsharded weights current now (a user's call, outside forward/backward)."""
        self.request_unshard()
        self.wait_unshard()

    def reshard(self, onto: PostForwardGroup | None = None) -> None:
        _await_gathers(self)
        for group in self.groups:
            group.reshard(onto)
        self._swap(use_unsharded=False)

    # ----------------------------------------------------------------- forward
    def pre_forward(
        self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        if not self.forwards.begin(module, alone=_outside_root_forward(self)):
            return cast_inputs(forward_policy(self.options, self.region), args, kwargs)
        if self.region is not None and torch.is_grad_enabled():
            _refuse_autograd_in_cast_region(self, self.region)
        if self.root is None:
            self._make_root(self)
        assert self.root is not None
        recomputing = in_backward_pass()
        log_event(self, "pre_forward (recompute)" if recomputing else "pre_forward")
        if (recorder := timeline.ACTIVE) is not None:
            recorder.forward_begins(self, root=self.root.root_unit is self, recompute=recomputing)
        if self.root.root_unit is self and not recomputing:
            self.root.pre_root_forward()
        if not recomputing:
            self._move_to(TrainingState.FORWARD)
        elif self.state is not TrainingState.POST_BACKWARD:  # done units stay done
            self._move_to(TrainingState.PRE_BACKWARD)
        if not recomputing:
            self.root.order.record(self)
            self._took_part |= torch.is_grad_enabled()
        self.unshard_async()
        self.wait_unshard()
        if not recomputing and self.options.overlap_param_gather:
            targets = self.root.order.forward_targets(self, self.forward_prefetch)
            gather_ahead(targets, coalesce=self.root.order.coalesce)
        args, kwargs = cast_inputs(forward_policy(self.options, self.region), args, kwargs)
        if not self._inputs_trigger_armed:  # a recompute of an armed forward needs none
            args, kwargs, self._inputs_trigger_armed = route_inputs_through_trigger(
                args, kwargs, self._end_own_backward
            )
        return args, kwargs

    def post_forward(self, module: nn.Module, args: Any, output: Any) -> Any:
        assert self.root is not None
        is_root = self.root.root_unit is self
        if torch.is_grad_enabled():
            register_pre_backward(output, self._pre_backward)
        if not self.forwards.finish(module):
            return output  # the unit's forward goes on in its other members
        log_event(self, "post_forward")
        self._end_forward(is_root)
        if is_root:
            for unit in self.root.units:  # units some member of which did not run
                if unit.forwards.abandon():
                    unit._end_forward(is_root=False)
            output = cast_outputs(forward_policy(self.options, self.region), output)
        if (recorder := timeline.ACTIVE) is not None:
            recorder.forward_ends(self)
        return output

    def _end_forward(self, is_root: bool) -> None:
        if in_backward_pass():  # recomputation: the weights stay for the backward
            return
        reshard = self.options.reshard_after_forward
        keep = is_root if reshard is None else not reshard
        grad = torch.is_grad_enabled()
        if not keep or (is_root and not grad):
            self.reshard(self.options.post_forward if grad else None)
        elif not grad:
            # No backward comes: the gathered weights wait in their buffers for the next forward,
            # but an optimizer built on model.parameters() now must get the sharded ones.
            self._swap(use_unsharded=False)
        self._move_to(TrainingState.IDLE)

    # ----------------------------------------------------------------- backward
    def _pre_backward(self, grad: torch.Tensor) -> None:
        assert self.root is not None
        self.root.begin_backward()
        if self.state in (TrainingState.PRE_BACKWARD, TrainingState.POST_BACKWARD):
            return  # another output's hook, or a late one after the unit's backward
        self._move_to(TrainingState.PRE_BACKWARD)
        log_event(self, "pre_backward")
        if (recorder := timeline.ACTIVE) is not None:
            recorder.backward_begins(self)
        self.unshard_async()
        self.wait_unshard()
        if self.options.overlap_param_gather:
            order, fraction = self.root.order, self.options.backward_prefetch_grad_fraction
            targets = order.backward_targets(self, self.backward_prefetch)
            # The root's own parameters get most of their gradients at the very end of
            # backward (embeddings): their share says nothing about its progress.
            force = self.root.root_unit is self
            self._prefetch.begin(targets, fraction, coalesce=order.coalesce, force=force)

    def _on_grad_ready(self, group: ParameterGroup, index: int, param: torch.Tensor) -> None:
        if param.grad is None:
            return
        grad = grad_local(param.grad, group.tp_specs[index])  # TP: reduced over DP only
        reducer = group.reducer
        assert self.root is not None and reducer is not None
        if self.post_backward_done:
            raise _gradient_after_backward(self.name, group.names[index])
        complete = self.root.grad_sync.accumulate(reducer, index, grad)
        param.grad = None
        self._prefetch.on_grad(grad.numel())
        # Every gradient here: the backward may end now. Only where an input-grad trigger
        # would end it anyway right after, with nothing issued in between, so a rank whose
        # data skipped a parameter issues the same collectives in the same order; units
        # without one end at the root's final callback. Frozen weights (no reducer) wait for
        # the trigger: no gradient says autograd is done with them (LoRA's base weight).
        if complete and self._inputs_trigger_armed and _all_received(self.groups):
            self._end_own_backward()

    def _end_own_backward(self) -> None:
        """Every gradient arrived, or the inputs' gradient did (the trigger's callback)."""
        if not self.post_backward_done:
            self._prefetch.issue(force=True)
            self.post_backward()

    def post_backward(self) -> None:
        """Reshard and issue gradient reductions once the unit's backward is done."""
        if self.post_backward_done:
            return
        assert self.root is not None
        self._move_to(TrainingState.POST_BACKWARD)
        log_event(self, "post_backward")
        if self.options.strategy.shards_params and self.options.reshard_after_backward:
            self.reshard()
        sync, streams = self.root.grad_sync, self.root.streams
        for group in self.groups:
            reducer = group.reducer
            # No forward, no gradient: grads stay None (as torch's), not zeros Adam steps.
            if reducer is not None and (self._took_part or reducer.has_grads):
                sync.reduce_after_backward(reducer, self.sync_flags, streams)
        if (recorder := timeline.ACTIVE) is not None:
            recorder.backward_ends(self)

    def reset_iteration(self) -> None:
        """FSDP2's ``reset_iter_state``: an exception ended the iteration midway."""
        self.forwards.abandon()
        self.reshard()
        self.end_backward()

    def end_backward(self) -> None:
        self._move_to(TrainingState.IDLE)
        self._prefetch.drop()
        self._inputs_trigger_armed = False
        self._took_part = False
        for group in self.groups:
            if group.reducer is not None:
                group.reducer.begin_backward()
        if self.options.reshard_after_backward:
            self.reshard()
