"""The gradient side of one parameter group: collect a backward's gradients, reduce them.

A ``GradReducer`` takes each parameter's unsharded gradient as autograd delivers it and,
once the unit's backward is done, launches one collective that reduces them into the
group's ``GradShard`` (the ``.grad`` the optimizer reads) through the group's reduce plan
(``reduce_plans``). What is in flight is a ``PendingReduction``, which only the root's
``ReductionQueue`` holds and waits on; waiting it also releases what the reduction read.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from mfsdp_buffers import Allocator, FlatLayout
from mfsdp_collectives import (
    CommAllocator,
    CommHandle,
    CommStreams,
    FSDPTopology,
    NonFiniteError,
    ReduceSpec,
    uses_caller_buffers,
)
from mfsdp_hooks.config.comm_hooks import CommHooks
from mfsdp_hooks.config.grad_allocator import pools_memory
from mfsdp_hooks.config.offload import GradLanding
from mfsdp_hooks.config.reduce_config import GradReduceConfig
from mfsdp_hooks.config.strategy import ShardingStrategy
from mfsdp_hooks.grads.grad_collector import GradCollector
from mfsdp_hooks.grads.grad_presence import Presence
from mfsdp_hooks.grads.grad_shard import GradShard
from mfsdp_hooks.grads.reduce_plans import ReduceInputs, choose_plan

__all__ = ["GradReducer", "PendingReduction", "named_non_finite"]


@dataclass
class PendingReduction:
    """One launched gradient reduction; ``wait()`` completes it and runs its plan's release
    (frees what it read, moves a ``no_shard`` result into the gradients)."""

    reducer: GradReducer
    handle: CommHandle
    release: Callable[[], None] = field(repr=False)
    done: bool = False

    def wait(self) -> None:
        if self.done:
            return
        self.done = True
        try:
            self.handle.wait()
        except NonFiniteError as error:  # an async quantized comm reports it where it lands
            reducer = self.reducer
            raise named_non_finite(error, reducer.layout, reducer.names, "gradient") from error
        self.release()

    def landed(self) -> bool:
        """Whether it landed (without blocking); ``wait()`` still completes it. A poll never
        raises: a failed reduction raises at ``wait()``, where every rank reaches it."""
        return self.handle.is_completed()


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
        names: Sequence[str] = (),
        landing: GradLanding | None = None,
    ) -> None:
        """``landing``: host offload's way home for the reduced gradients (``config.offload``):
        the collectives reduce on the device, the gradients live on the host."""
        self.layout = layout
        self.landing = landing
        self.grads = grads
        self.topology = topology
        self.strategy = strategy
        self._dist_params = tuple(dist_params)
        self._allocator = allocator
        self.reduce_dtype = reduce_dtype
        self.names = list(names)
        self.hooks = CommHooks()  # none set: the built-in collectives
        self._reduce_config = reduce_config
        self.presence: Presence | None = None
        """Who had a gradient in the reductions since the last agreement (``grad_presence``)."""
        self._build()

    def _build(self) -> None:
        """The collector and plan for the current hooks (a custom reduce-scatter allocates
        the buffer it reads, unless it ``uses_caller_buffers``)."""
        topology, strategy, custom = self.topology, self.strategy, self.hooks.reduce_scatter
        allocator: Allocator = self._allocator
        if custom is not None and not uses_caller_buffers(custom):
            allocator = CommAllocator(custom)
        # Per-parameter gradients are kept as they arrive when the reduce-scatter can read
        # them in place; a pre-scale then becomes the same post-scale on the output shard.
        in_place = (
            topology.device.type == "cpu"
            and strategy != ShardingStrategy.NO_SHARD
            and not pools_memory(allocator)
            and topology.host_transport is not None
            and custom is None
        )
        self._in_place = in_place
        self._native_average = in_place or dist.get_backend(topology.shard_group) != "gloo"
        self._collector = GradCollector(
            self.layout,
            reduce_dtype=self.reduce_dtype,
            device=topology.device,
            allocator=allocator,
            hold=in_place,
        )
        inputs = ReduceInputs(
            self._collector, self.grads, self._dist_params, topology, self.landing
        )
        partial = self.layout.shard_numel
        self._plan = choose_plan(inputs, strategy=strategy, partial_numel=partial)
        self.configure(self._reduce_config)

    def use_comm_hooks(self, hooks: CommHooks) -> None:
        """Reduce through the unit's hooks (``config.comm_hooks``) from the next backward on;
        only between steps, like a change of dtype."""
        self._refuse_while_collected("communication hooks")
        rebuild = hooks.reduce_scatter is not self.hooks.reduce_scatter
        self.hooks = hooks
        if rebuild:
            self._build()
        else:
            self.configure(self._reduce_config)

    def configure(self, reduce_config: GradReduceConfig) -> None:
        """How gradients are scaled and averaged from the next reduction on."""
        self._reduce_config = reduce_config
        topology = self.topology
        # HSDP: the mean is over every data-parallel rank, inside and across the replicas.
        average, input_scale = reduce_config.collective_args(
            topology.shard_size * topology.outer_size, self._native_average
        )
        output_scale: float | None = None
        if self._in_place:  # kept as they arrive: a pre-scale becomes the same post-scale
            output_scale, input_scale = input_scale, None
        self._collector.input_scale = input_scale
        self._spec = ReduceSpec(
            average=average,
            post_scale=output_scale,
            reduce_dtype=self.reduce_dtype,
            sum_only=self.hooks.force_sum,
        )

    def set_reduce_dtype(self, dtype: torch.dtype) -> None:
        """Reduce in ``dtype`` from the next backward on (``mixed_precision_context``);
        only between steps: gradients collected in one dtype are not re-cast."""
        if dtype == self.reduce_dtype:
            return
        self._refuse_while_collected("the gradient reduction's dtype")
        self.reduce_dtype = self._collector.reduce_dtype = dtype
        self._spec = dataclasses.replace(self._spec, reduce_dtype=dtype)

    def _refuse_while_collected(self, what: str) -> None:
        if self.has_grads:
            raise RuntimeError(
                f"{what} can change only between steps: gradients are waiting to be reduced"
            )

    # ----------------------------------------------------------------- collect
    def accumulate(self, index: int, grad: torch.Tensor) -> bool:
        """``GradCollector.accumulate``: the caller settles this group's reduction first."""
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
        return self._plan.needs_outer_sync

    def start_reduction(
        self, streams: CommStreams | None, *, ends_cycle: bool = True
    ) -> PendingReduction:
        """Issue the reduction of what was collected into the gradients the optimizer reads.

        ``ends_cycle=False`` (a ``no_sync`` micro-batch under HSDP/HFSDP): the reduction
        stays inside the shard group; the one that ends the cycle crosses the replicas.
        """
        had = self._collector.presence()
        if self.presence is None:  # what the parameters held before this window's reductions
            kept = [self.grads.held(p) is not None for p in self._dist_params]
            self.presence = Presence(had, kept)
        else:
            self.presence.add(had)
        try:
            launched = self._plan.issue_collectives(
                self._spec, streams, ends_cycle=ends_cycle, hooks=self.hooks
            )
        except NonFiniteError as error:  # a quantized comm: name the parameter
            raise named_non_finite(error, self.layout, self.names, "gradient") from error
        release = launched.release
        if self.landing is not None:
            release = self.landing.after(release, streams)
        return PendingReduction(self, launched.handle, release)

    def drop_partial(self) -> None:
        """Forget the ``no_sync`` parts kept in the shard group (the gradients were zeroed)."""
        self._plan.drop_partial()

    def drop_absent(self, agreed: Sequence[bool]) -> None:
        """``agreed[i]``: some rank had a gradient for parameter ``i`` in this window. The
        others that held none before it get none (torch's ``None``, not a reduced zero)."""
        presence, self.presence = self.presence, None
        if presence is None:
            return
        absent = [
            i
            for i, (some, kept) in enumerate(zip(agreed, presence.kept, strict=True))
            if not some and not kept
        ]
        self.grads.drop(self._dist_params, absent)


def named_non_finite(
    error: NonFiniteError, layout: FlatLayout, names: Sequence[str], what: str, offset: int = 0
) -> FloatingPointError:
    """``error`` (element ``offset + error.index`` of the unsharded flat buffer: ``offset``
    is where the erring sender's input starts) told as the parameter holding it."""
    index = offset + error.index
    for placement, name in zip(layout.placements, names, strict=False):
        if placement.offset <= index < placement.offset + placement.numel:
            element = index - placement.offset
            return FloatingPointError(
                f"the {what} of {name} holds a non-finite value on rank {error.rank} (element "
                f"{element} of {placement.numel}), so it cannot be quantized for the "
                "collective: check the loss scale or the step that produced it"
            )
    return error
