"""Pipeline parallelism over megatron-fsdp stages: torch's ``PipelineStage``, without FSDP2's
private state.

``torch.distributed.pipelining`` composes with data parallelism by recognising the stage
module: for an FSDP2 module it turns gradient sync off for every micro-batch's backward
(``set_requires_gradient_sync(False)``, ``set_reshard_after_backward(False)``), and after the
last one a ``REDUCE_GRAD`` action (``perform_reduce_grad``) turns it back on and runs each
FSDP2 parameter group's ``post_backward`` and the root's final callback, found through
``fully_shard.state(module)``: FSDP2's private state, which our units do not have. Shape
inference (dynamic metadata) also runs one real forward and an input-only backward, whose
end our units would take for a synced backward and reduce.

:class:`PipelineStage` does those steps through our public calls, on each outermost sharded
module of the stage (``sharded_roots``: also inside a root wrapper, which torch does not
recognise); each method says which. Our DP reduction averages over the DP ranks and
``scale_grads`` divides by the micro-batches: together one mean over the global batch, as
one process computes it.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch import nn
from torch.distributed import pipelining

from mfsdp_hooks.api.fsdp_module import FSDPModule

__all__ = ["PipelineStage", "sharded_roots"]


def sharded_roots(module: nn.Module) -> list[FSDPModule]:
    """The outermost megatron-fsdp modules of ``module``, in module order: ``module`` itself
    when it is sharded (per-module ``fully_shard`` on the stage root), the wrapped model
    inside a root wrapper (``FSDPRootWrapper``), or each sharded child of a plain container."""
    if isinstance(module, FSDPModule):
        return [module]
    found: list[FSDPModule] = []
    for child in module.children():
        found += sharded_roots(child)
    return found


def _sharded_modules(module: nn.Module) -> Iterator[FSDPModule]:
    for sub in module.modules():
        if isinstance(sub, FSDPModule):
            yield sub


class PipelineStage(pipelining.PipelineStage):
    """``torch.distributed.pipelining.PipelineStage`` for a stage module sharded by
    megatron-fsdp (per-module ``fully_shard`` on its blocks and root, or a root wrapper:
    ``FSDPRootWrapper``, which ``megatron_fsdp.fully_shard_model`` returns). Same arguments,
    same schedules; each unit reduces its gradients once per schedule step. A stage without
    our units behaves exactly as torch's."""

    def __init__(
        self,
        submodule: nn.Module,
        *args: Any,
        reduce_scatter_each_microbatch: bool = False,
        **kwargs: Any,
    ) -> None:
        """``reduce_scatter_each_microbatch`` (ZeRO-2/3): False (the default) keeps each
        unit's unsharded gradients over the step's micro-batches and reduce-scatters them
        once, at ``REDUCE_GRAD``, as FSDP2 does under a pipeline; True reduce-scatters every
        micro-batch's and keeps only the shard (Megatron-FSDP's ``no_sync``: a gradient
        shard instead of a full gradient per unit between micro-batches, at one
        reduce-scatter per unit per micro-batch). The stage sets its roots'
        ``reduce_scatter_in_no_sync`` to it for its backwards and puts the roots' own value
        back after each ``REDUCE_GRAD``."""
        if not isinstance(reduce_scatter_each_microbatch, bool):
            raise TypeError(
                "reduce_scatter_each_microbatch must be a bool, got "
                f"{reduce_scatter_each_microbatch!r}"
            )
        super().__init__(submodule, *args, **kwargs)
        self._mfsdp_roots = sharded_roots(submodule)
        self._reduce_scatter_each_microbatch = reduce_scatter_each_microbatch
        # Each root's own reduce_scatter_in_no_sync while the stage's backwards run (None:
        # no backward since the last REDUCE_GRAD).
        self._roots_own_setting: list[bool] | None = None
        self._synced = False  # perform_reduce_grad ran: an optimizer may step before the next

    def _begin_accumulation(self) -> None:
        """The step's first backward: the roots follow the stage's reduce-scatter choice."""
        if self._roots_own_setting is None:
            self._roots_own_setting = self._set_roots(self._reduce_scatter_each_microbatch)

    def _end_accumulation(self) -> None:
        if self._roots_own_setting is not None:
            self._set_roots(self._roots_own_setting)
            self._roots_own_setting = None

    def _set_roots(self, reduce_scatter_in_no_sync: bool | list[bool]) -> list[bool]:
        """The roots' ``reduce_scatter_in_no_sync`` set (one value, or one per root); returns
        what they were."""
        roots = self._mfsdp_roots
        before = [root.reduce_scatter_in_no_sync for root in roots]
        if isinstance(reduce_scatter_in_no_sync, bool):
            reduce_scatter_in_no_sync = [reduce_scatter_in_no_sync] * len(roots)
        for root, setting in zip(roots, reduce_scatter_in_no_sync, strict=True):
            root.set_reduce_scatter_in_no_sync(setting)
        return before

    def clear_runtime_states(self) -> None:
        """At the start of every schedule step: the weights an optimizer updated since the
        last ``perform_reduce_grad`` are installed, once. The units would otherwise install
        them again at every forward (and schedule ``UNSHARD``) until the next backward: as
        far as they know a bare optimizer may step at any moment until then, and a pipeline
        runs several forwards before its first backward. None steps inside a schedule step."""
        super().clear_runtime_states()
        if self._synced:
            self._synced = False
            for root in self._mfsdp_roots:
                root.install_optimized_model_weights()

    def backward_maybe_with_nosync(
        self, backward_type: Any, bwd_kwargs: dict[str, Any], last_backward: bool = False
    ) -> Any:
        """Every micro-batch's backward accumulates locally; ``perform_reduce_grad`` syncs.

        Zero-bubble schedules split a backward into its input pass (``"input"``) and, later,
        its weight pass (``"weight"``), both of which read ``submod.parameters()`` as the
        parameters the forward's graph used: the units are gathered first (a no-op where
        they are). torch's weight pass sets each ``.grad`` by hand, which no unit sees; the
        gradients are handed to the units through autograd (see ``_hand_grads_to_units``).
        """
        self._begin_accumulation()
        for root in self._mfsdp_roots:
            root.set_reshard_after_backward(False)
            root.set_requires_gradient_sync(False)
        split = backward_type in ("input", "weight") and bool(self._mfsdp_roots)
        if split:
            for module in _sharded_modules(self.submod):
                module.unshard()
        result = super().backward_maybe_with_nosync(backward_type, bwd_kwargs, last_backward)
        if split and backward_type == "weight":
            self._hand_grads_to_units()
        return result

    def _hand_grads_to_units(self) -> None:
        """The weight pass's gradients, set on the gathered parameters by hand, go through
        autograd's accumulation instead, whose hooks hand them to their units (which add
        them up for ``perform_reduce_grad``); ``.grad`` is then as before."""
        params, grads = [], []
        for param in self.submod.parameters():
            if param.grad is not None:
                params.append(param)
                grads.append(param.grad)
                param.grad = None
        if params:
            torch.autograd.backward(params, grads)

    def perform_reduce_grad(self, grad_scale_factor: int) -> None:
        """The step's one reduction per unit (torch's reaches into FSDP2's state instead),
        then the units resharded and the reduced gradients scaled."""
        if not self._mfsdp_roots:
            super().perform_reduce_grad(grad_scale_factor)
            return
        for root in self._mfsdp_roots:
            root.set_reshard_after_backward(True)
            root.set_requires_gradient_sync(True)
        for root in self._mfsdp_roots:
            root.finish_grad_sync()
        self._end_accumulation()
        for module in _sharded_modules(self.submod):
            module.reshard()
        self._synced = True
        if grad_scale_factor != 1:
            self.scale_grads(grad_scale_factor)

    def _compute_input_grads(
        self,
        outputs: list[torch.Tensor],
        all_fwd_inputs: list[torch.Tensor],
        grad_outputs: list[torch.Tensor | None] | None = None,
    ) -> tuple[torch.Tensor | None, ...]:
        """Shape inference's input-only backward: computes no parameter gradient, so its end
        must reduce nothing, not even a shard inside ``dp_shard`` (each unit's own sync flag
        and the roots' own ``reduce_scatter_in_no_sync`` are put back after)."""
        flags = [(m, m.requires_gradient_sync) for m in _sharded_modules(self.submod)]
        for module, _ in flags:
            module.set_requires_gradient_sync(False, recurse=False)
        own = self._set_roots(False)
        try:
            grads: tuple[torch.Tensor | None, ...] = super()._compute_input_grads(
                outputs, all_fwd_inputs, grad_outputs
            )
        finally:
            for module, flag in flags:
                module.set_requires_gradient_sync(flag, recurse=False)
            self._set_roots(own)
        return grads
