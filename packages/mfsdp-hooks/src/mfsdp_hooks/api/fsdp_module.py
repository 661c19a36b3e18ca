"""The methods every fully-sharded module gains: FSDP2's ``FSDPModule`` API, on our units.

Every public method of torch's ``FSDPModule`` (our base) is ours, implemented here or refused
in ``fsdp2_refusals``. Setters with ``recurse`` apply to every unit in the module's subtree
unless ``recurse=False``, as FSDP2's do.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule as TorchFSDPModule
from torch.distributed.fsdp import UnshardHandle as TorchUnshardHandle

from mfsdp_hooks.api.ddp_refusal import RefusesDDP
from mfsdp_hooks.api.describe import ShardingSummary, describe
from mfsdp_hooks.api.fsdp2_comm_hooks import FSDP2CommHooks
from mfsdp_hooks.api.fsdp2_refusals import FSDP2Refusals
from mfsdp_hooks.api.module_conversion import managed_params_hidden
from mfsdp_hooks.config.mixed_precision import MixedPrecisionPolicy, as_policy
from mfsdp_hooks.config.reduce_config import GradReduceConfig
from mfsdp_hooks.config.unit_options import RootOptions
from mfsdp_hooks.runtime.compute_region import enter_region, leave_region
from mfsdp_hooks.runtime.root import FSDPRoot, root_of
from mfsdp_hooks.runtime.unit import FSDPUnit, unit_of, units_under

__all__ = ["FSDPModule", "UnshardHandle"]


class UnshardHandle(TorchUnshardHandle):
    """Returned by ``unshard(async_op=True)``, as in FSDP2: ``wait()`` before using the weights."""

    def __init__(self, unit: FSDPUnit) -> None:
        self._unit: FSDPUnit | None = unit

    def wait(self) -> None:
        if self._unit is not None:
            self._unit.wait_unshard()
            self._unit = None


class FSDPModule(FSDP2CommHooks, FSDP2Refusals, RefusesDDP, TorchFSDPModule):
    """Methods every fully-sharded module gains (mixed into its class)."""

    def unshard(self, async_op: bool = False) -> UnshardHandle | None:
        """Gather this module's parameters now; with ``async_op`` return a handle to wait on."""
        unit = self._mfsdp_unit()
        unit.request_unshard()
        if async_op:
            return UnshardHandle(unit)
        unit.wait_unshard()
        return None

    def reshard(self) -> None:
        self._mfsdp_unit().reshard()

    def set_requires_gradient_sync(
        self, requires_gradient_sync: bool, *, recurse: bool = True
    ) -> None:
        """While False, the units' backwards keep their unsharded gradients local, and the
        next backward with True (or ``finish_grad_sync``) reduces them with its own, as
        FSDP2's do (under ``reduce_scatter_in_no_sync`` ZeRO-2/3 units still reduce-scatter
        inside ``dp_shard``). ``recurse`` (FSDP2's): this module's unit only, or every
        unit under it; each unit follows its own flag."""
        _check_bool(requires_gradient_sync, "requires_gradient_sync")
        for unit in self._units(recurse=recurse):
            unit.sync_flags.requires_gradient_sync = requires_gradient_sync

    @property
    def requires_gradient_sync(self) -> bool:
        """Whether this unit's next backward reduces its gradients (False inside ``no_sync``)."""
        return self._mfsdp_unit().sync_flags.requires_gradient_sync

    @property
    def sync_model_each_microbatch(self) -> bool:
        return self._root_options().sync_model_each_microbatch

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        self.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            self.set_requires_gradient_sync(True)

    def set_modules_to_forward_prefetch(
        self, modules: Sequence[nn.Module | TorchFSDPModule]
    ) -> None:
        self._mfsdp_unit().forward_prefetch = [_require_unit(m, "modules") for m in modules]

    def set_modules_to_backward_prefetch(
        self, modules: Sequence[nn.Module | TorchFSDPModule]
    ) -> None:
        self._mfsdp_unit().backward_prefetch = [_require_unit(m, "modules") for m in modules]

    def start_grad_sync(self) -> None:
        """Launch the reductions of what ``no_sync`` kept local, without waiting for them
        (``finish_grad_sync`` waits)."""
        root = root_of(self)  # type: ignore[arg-type]
        if root is not None:
            root.start_grad_sync()

    def finish_grad_sync(self) -> None:
        """Wait for every gradient reduction and reduce what ``no_sync`` kept local."""
        root = root_of(self)  # type: ignore[arg-type]
        if root is not None:
            root.finish_grad_sync()

    def zero_grad_buffer(self) -> None:
        for unit in self._units(recurse=True):
            for group in unit.groups:
                group.zero_main_grads()

    def install_optimized_model_weights(self) -> None:
        """Copy optimizer-updated weights into the compute weights now instead of lazily."""
        for unit in self._units(recurse=True):
            for group in unit.groups:
                if not group.requires_grad:  # no optimizer steps frozen weights
                    group.freshness.close_step_window(stepped=False)
                    continue
                group.freshness.close_step_window(stepped=True)
                handle = group.install_weights()
                if handle is not None:
                    handle.wait()

    def reset_iter_state(self) -> None:
        """FSDP2's: after an exception in forward or backward, make the next iteration
        start clean (call it on the root; a unit not yet under a root is reset alone)."""
        root = root_of(self)  # type: ignore[arg-type]
        if root is not None:
            root.reset_iteration()
        else:
            self._mfsdp_unit().reset_iteration()

    def describe_sharding(self, optimizer: torch.optim.Optimizer | None = None) -> ShardingSummary:
        """Every unit under this module on this rank: parameters, mesh, dtypes on the wire
        and bytes by category (``print`` it for a table); ``optimizer`` adds its state.
        See ``mfsdp_hooks.api.describe``. (Not ``describe``: the class it is mixed into
        comes after ``FSDPModule`` and may have a method of that name.)"""
        module: nn.Module = self  # type: ignore[assignment]
        return describe(module, optimizer)

    @property
    def fsdp_root(self) -> FSDPRoot | None:
        return root_of(self)  # type: ignore[arg-type]

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> Any:
        """``model.to(...)`` and friends after sharding: see ``module_conversion``."""
        module: nn.Module = self  # type: ignore[assignment]
        with managed_params_hidden(module, fn):
            # Past torch's FSDPModule._apply, which re-reads FSDP2's private state.
            return super(TorchFSDPModule, self)._apply(fn, recurse)  # type: ignore[misc]

    # ------------------------------------------------------------ FSDP2's runtime setters
    def _units(self, recurse: bool) -> list[FSDPUnit]:
        module: nn.Module = self  # type: ignore[assignment]
        modules = module.modules() if recurse else [module]
        return units_under(modules)

    def set_reshard_after_forward(self, reshard_after_forward: bool, recurse: bool = True) -> None:
        """Reshard after forward (True, the root included, over the whole shard group, as
        FSDP2's setter does even after an int) or keep the weights for backward."""
        _check_bool(reshard_after_forward, "reshard_after_forward")
        for unit in self._units(recurse):
            unit.options = dataclasses.replace(
                unit.options,
                reshard_after_forward=reshard_after_forward,
                reshard_after_forward_group_size=None,
                post_forward=None,
            )

    def set_reshard_after_backward(
        self, reshard_after_backward: bool, *, recurse: bool = True
    ) -> None:
        """False keeps the gathered weights after backward (gradient accumulation trades
        memory for the next forward's all-gather); updated weights are still re-gathered."""
        for unit in self._units(recurse):
            unit.options = dataclasses.replace(
                unit.options, reshard_after_backward=bool(reshard_after_backward)
            )

    def set_sync_model_each_microbatch(self, sync_model_each_microbatch: bool) -> None:
        """Finish every micro-batch's reductions in its own backward (True) or let ``no_sync``
        micro-batches' reductions overlap the next one (False). A root-level option: call it
        on the root; it applies to the whole tree, from the next backward on."""
        _check_bool(sync_model_each_microbatch, "sync_model_each_microbatch")
        self._set_root_option(
            "set_sync_model_each_microbatch", sync_model_each_microbatch=sync_model_each_microbatch
        )

    def set_reduce_scatter_in_no_sync(self, reduce_scatter_in_no_sync: bool) -> None:
        """``RootOptions.reduce_scatter_in_no_sync``. A root-level option: call it on the
        root; it applies to the whole tree, from the next backward on."""
        _check_bool(reduce_scatter_in_no_sync, "reduce_scatter_in_no_sync")
        self._set_root_option(
            "set_reduce_scatter_in_no_sync", reduce_scatter_in_no_sync=reduce_scatter_in_no_sync
        )

    @property
    def reduce_scatter_in_no_sync(self) -> bool:
        return self._root_options().reduce_scatter_in_no_sync

    def _root_options(self) -> RootOptions:
        """The root-level options this unit runs under: its root's once the first forward
        built it, until then what its ``fully_shard`` call was given."""
        root = root_of(self)  # type: ignore[arg-type]
        return self._mfsdp_unit().options.root if root is None else root.root_options

    def _set_root_option(self, setter: str, **change: bool) -> None:
        """One root-level option changed for the whole tree (``setter`` names the caller)."""
        root = self._root_only(setter)
        options = dataclasses.replace(self._root_options(), **change)
        if root is not None:
            root.set_root_options(options)
            return
        for unit in self._units(recurse=True):  # before the first forward built the root
            unit.options = dataclasses.replace(unit.options, root=options)

    def _root_only(self, setter: str) -> FSDPRoot | None:
        """The root, for a root-level setter: raises when called on a non-root unit."""
        root = root_of(self)  # type: ignore[arg-type]
        if root is not None and root.root_unit is not self._mfsdp_unit():
            raise ValueError(
                f"{setter} on {type(self).__name__}, which is not the FSDP root: call it on "
                "the root module (it applies to the whole tree)"
            )
        return root

    def set_gradient_divide_factor(self, factor: float) -> None:
        """Gradients are summed over the ranks and divided by ``factor`` (instead of the
        number of ranks), for this module's own unit."""
        if not factor > 0:
            raise ValueError(f"factor must be positive, got {factor!r}")
        config = GradReduceConfig(average_in_collective=False, gradient_scaling_factor=1 / factor)
        for group in self._mfsdp_unit().groups:
            if group.reducer is not None:
                group.reducer.configure(config)

    def set_reduce_scatter_divide_factor(self, factor: float) -> None:
        """FSDP2's older name of :meth:`set_gradient_divide_factor`."""
        self.set_gradient_divide_factor(factor)

    def set_is_last_backward(self, is_last_backward: bool) -> None:
        """Accepted for FSDP2 code, on the root (a root-level flag; a non-root unit raises).
        Ours always finishes a synced backward's reductions at its end, which is what True
        asks; False only lets FSDP2 skip that wait, so the gradients are the same."""
        _check_bool(is_last_backward, "is_last_backward")
        self._root_only("set_is_last_backward")

    def set_requires_all_reduce(self, requires_all_reduce: bool, *, recurse: bool = True) -> None:
        """HSDP: False reduce-scatters inside ``dp_shard`` only and accumulates the partial
        shards; the next backward with True (or ``finish_grad_sync``, which the attached
        optimizer's step calls) all-reduces the accumulated shard across ``dp_outer`` once.
        ZeRO-0/1 keep such gradients local, as under ``no_sync``. Each unit follows its own
        flag (``recurse``: every unit under this module, or its own only)."""
        _check_bool(requires_all_reduce, "requires_all_reduce")
        for unit in self._units(recurse):
            unit.sync_flags.requires_all_reduce = requires_all_reduce

    def mixed_precision_context(self, policy: Any) -> contextlib.AbstractContextManager[None]:
        """Another mixed-precision policy for every unit under this module for a region
        (see ``FSDPRootWrapper.mixed_precision_context``); call it on the root."""
        self._root_only("mixed_precision_context")
        return _policy_region(self._units(recurse=True), policy)

    @property
    def mixed_precision_policy(self) -> MixedPrecisionPolicy:
        """The policy this module's unit was wrapped with (a region's starting point)."""
        return self._mfsdp_unit().options.policy

    def set_post_optim_event(self, event: torch.Event) -> None:
        """Not supported yet: the all-gather after a step waits on the current stream."""
        raise NotImplementedError(
            "set_post_optim_event: waiting the all-gather stream on a user event is not "
            "supported yet; the next all-gather already waits for the optimizer step"
        )


@contextlib.contextmanager
def _policy_region(units: list[FSDPUnit], policy: Any) -> Iterator[None]:
    """``units`` follow ``policy`` (ours, or torch FSDP2's) inside, the wrap-time policy again
    after, even when the region raises (``runtime.compute_region``). Regions do not nest."""
    converted = as_policy(policy, "mixed_precision_context: policy")
    enter_region(units, converted)
    try:
        yield
    finally:
        leave_region(units)


def _check_bool(value: object, name: str) -> None:
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be a bool, got {value!r}")


def _require_unit(module: object, argument: str) -> FSDPUnit:
    unit = unit_of(module) if isinstance(module, nn.Module) else None
    if unit is None:
        raise ValueError(
            f"{argument}: {type(module).__name__} is not fully sharded; "
            "call fully_shard on it first"
        )
    return unit
