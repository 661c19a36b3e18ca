"""One FSDP unit's parameters of one dtype: their flat buffers and the parameters users see.

Laid out by one ``FlatLayout``: compute weights (sharded for ZeRO-3, where nothing of them
persists when main weights exist apart: the main shard is cast in before each gather; whole
otherwise), main weights in the optimizer's dtype where it differs, and the reduced gradients
(a ``GradShard`` the distributed parameters' ``.grad`` views, reduced by ``reducer``). Under
HFSDP ``layout`` cuts the persistent ``dp_shard`` compute shards and ``optim_layout`` the
``dp_shard x dp_outer`` sub-shards of all the optimizer sees (``shard_cuts``); after a step
the sub-shards are all-gathered across ``dp_outer`` once (``_refresh_compute_shard``). The
unsharded parameters (views of the unsharded buffer) and the distributed ones (DTensors over
the optimizer-facing shard) are made once, at wrap time.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial
from typing import Protocol

import torch
import torch.distributed as dist
from torch import nn

from mfsdp_buffers import Allocator, DataParallelBuffer, FlatLayout, PlainAllocator
from mfsdp_collectives import (
    AllGatherComm,
    CommHandle,
    CommStreams,
    FSDPTopology,
    NonFiniteError,
    PostForwardGroup,
    Route,
)
from mfsdp_hooks.config.codec import IDENTITY, ParamClassCodec, ParamCodec
from mfsdp_hooks.config.mixed_precision import MixedPrecisionPolicy
from mfsdp_hooks.config.offload import GradLanding, HostOffload, encode_main
from mfsdp_hooks.config.reduce_config import GradReduceConfig
from mfsdp_hooks.config.strategy import ShardingStrategy
from mfsdp_hooks.dtensor.tensor_parallel import local_value, tp_spec_of
from mfsdp_hooks.grads.grad_reducer import GradReducer, named_non_finite
from mfsdp_hooks.grads.grad_shard import GradShard
from mfsdp_hooks.weights.group_storage import (
    adopt_params,
    check_shardable,
    fill_buffers,
    grad_shard,
    weight_buffers,
)
from mfsdp_hooks.weights.post_forward_shard import PostForwardShard
from mfsdp_hooks.weights.shard_cuts import ShardCuts
from mfsdp_hooks.weights.weight_freshness import WeightFreshness, WeightPath, weight_path

DEFAULT_ALIGNMENT = 16


class Waitable(Protocol):
    """What an unshard hands back: ``wait()`` before using the compute weights."""

    def wait(self) -> None: ...


class GroupRoot(Protocol):
    """What the optimizer integration asks of the root behind a parameter group."""

    def finish_grad_sync(self) -> None: ...


class _AfterLanding:
    """A gather followed, once it has landed, by one step on this rank (the codec rebuilding
    the compute weights, or this rank's weights put back where a custom comm wrote)."""

    def __init__(self, handle: Waitable, then: Callable[[], object]) -> None:
        self._handle = handle
        self._then: Callable[[], object] | None = then

    def wait(self) -> None:
        self._handle.wait()
        then, self._then = self._then, None
        if then is not None:
            with torch.no_grad():
                then()


class _NamingNonFinite:
    """A gather through a custom comm (a quantized one) whose non-finite weight is reported
    as the parameter that holds it (the comm knows only its rank and element); each sender
    sent ``sent_numel`` values of the flat buffer, in rank order."""

    def __init__(
        self, handle: Waitable, layout: FlatLayout, names: Sequence[str], sent_numel: int
    ) -> None:
        self._handle, self._layout, self._names = handle, layout, names
        self._sent_numel = sent_numel

    def wait(self) -> None:
        try:
            self._handle.wait()
        except NonFiniteError as error:
            offset = error.rank * self._sent_numel  # where the sender's values start
            raise named_non_finite(error, self._layout, self._names, "weight", offset) from error


def _require_main_weights(
    codec: ParamCodec, main: object, name: str, compute_dtype: torch.dtype
) -> None:
    """A codec encodes the main weights into the wire buffer: they must exist apart."""
    if codec is not IDENTITY and main is None:
        raise NotImplementedError(
            f"param_codec={type(codec).__name__} for {name!r} needs main weights apart "
            f"from the compute weights, but both are {compute_dtype}: pass a "
            "MixedPrecisionPolicy whose param_dtype differs from main_params_dtype"
        )


def _gather_routes(topology: FSDPTopology) -> tuple[Route, Route | None]:
    """The gathers' groups and transports, checked once: a group's buffers are laid out for
    them, so the gathers of every step check nothing again (the HFSDP outer one, if any)."""
    shard = Route(topology.shard_group, topology.host_transport)
    outer = topology.outer_group if topology.shards_optimizer_across_outer else None
    return shard, None if outer is None else Route(outer, topology.outer_transport)


class ParameterGroup:
    """The parameters of one FSDP unit that share dtype and ``requires_grad``."""

    _post_forward: PostForwardShard | None = None
    """FSDP2's int ``reshard_after_forward``: this rank's slice of the gathered weights, held
    from ``reshard(onto=...)`` after forward to the next unshard, which gathers from it."""
    _onto: Route | None = None  # the route of the group resharded onto after forward
    all_gather_comm: AllGatherComm | None = None  # set_custom_all_gather's: runs the gathers

    def __init__(
        self,
        params: Sequence[nn.Parameter],
        names: Sequence[str],
        *,
        topology: FSDPTopology,
        strategy: ShardingStrategy,
        policy: MixedPrecisionPolicy,
        reduce_config: GradReduceConfig,
        grad_allocator: Allocator | None = None,
        alignment: int = DEFAULT_ALIGNMENT,
        codec: ParamCodec = IDENTITY,
        class_codec: ParamClassCodec | None = None,
        shard_dims: Sequence[int] = (),
        offload: HostOffload | None = None,
    ) -> None:
        """``codec`` carries the weights of every gather; ``class_codec`` (claimed parameters, e.g.
        float8 weights) is bound to it and decides what travels too. ``shard_dims``: each one's cut
        dim (default 0). ``offload``: main weights and gradients host-side (``config.offload``)."""
        self.names, self.offload = list(names), offload
        self.root: GroupRoot | None = None
        self.full_names = list(names)  # under the root module, once one holds this group
        self.topology = topology
        self.shard_route, self._outer_route = _gather_routes(topology)
        self.strategy, self.requires_grad = strategy, params[0].requires_grad
        self.original_dtype = params[0].dtype
        # Tensor parallelism: the TP-local tensors are what FSDP flattens and shards.
        self.tp_specs = [tp_spec_of(p, topology.tp_mesh) for p in params]
        values = [local_value(p) for p in params]
        self.shapes = [v.shape for v in values]
        check_shardable(self.names, self.shapes)
        self.cuts = ShardCuts(
            self.shapes,
            topology,
            alignment=alignment,
            tp_specs=self.tp_specs,
            shard_dims=shard_dims,
        )
        self.layout, self.optim_layout = self.cuts.layout, self.cuts.optim_layout
        self.compute_dtype = policy.compute_dtype(self.original_dtype)
        self.wrap_reduce_dtype = policy.grad_reduce_dtype(self.original_dtype)
        optimizer_dtype = policy.optimizer_dtype(self.original_dtype)
        bound = None
        if class_codec is not None:
            bound = class_codec.bind(params, self.cuts.codec_context(self.compute_dtype))
            codec, self.compute_dtype = bound, bound.wire_dtype
            values = [bound.high_precision(i) for i in range(len(params))]
        self.model, self.main = weight_buffers(
            self.cuts,
            strategy,
            self.names[0],
            compute_dtype=self.compute_dtype,
            optimizer_dtype=optimizer_dtype,
            offload=offload,
        )
        _require_main_weights(codec, self.main, names[0], self.compute_dtype)
        self.codec = codec
        self.grads: GradShard | None = None
        if self.requires_grad:
            self.grads = grad_shard(
                self.cuts,
                strategy,
                self.names[0],
                grad_dtype=policy.grad_dtype(self.original_dtype),
                optimizer_dtype=optimizer_dtype,
                make_dtensor=self.cuts.dtensor,
                attribute=policy.grad_attribute,
                offload=offload,
            )
        fill_buffers(self.model, self.main, values, encoded=bound is not None)
        self.unsharded_params = adopt_params(self.model, params, self.tp_specs, bound)
        self.dist_params = self.cuts.dist_params(self.stepped, strategy, originals=params)
        self.freshness = WeightFreshness(steppable=self.requires_grad)
        if bound is not None or (topology.shards_optimizer_across_outer and codec is not IDENTITY):
            # encoded compute weights exist only once the first gather or install made them
            self.freshness.mark_dirty()
        self.reducer = None if self.grads is None else _reducer(self, reduce_config, grad_allocator)

    @property
    def reduce_dtype(self) -> torch.dtype:
        """The dtype gradients are reduced in now: the reducer's (a ``mixed_precision_context``
        may change it for a region), the policy's (``wrap_reduce_dtype``) without one."""
        return self.wrap_reduce_dtype if self.reducer is None else self.reducer.reduce_dtype

    # ----------------------------------------------------------------- weights
    @property
    def is_unsharded(self) -> bool:
        return self.model.is_materialized

    def unshard(self, streams: CommStreams | None = None) -> Waitable | None:
        """Start making the unsharded weights current; wait on the returned handle before use."""
        return self._make_current(self._path(stale=self.freshness.dirty, unsharding=True), streams)

    @property
    def stepped(self) -> DataParallelBuffer:
        """The weights the optimizer steps: the main weights where kept, else the model's."""
        return self.main if self.main is not None else self.model

    @property
    def _whole_main(self) -> bool:
        """Each rank holds the whole optimizer-facing weights (nothing to gather)."""
        return self.strategy == ShardingStrategy.NO_SHARD or self.topology.shard_size == 1

    def _path(self, *, stale: bool, unsharding: bool) -> WeightPath:
        return weight_path(
            sharded=self.model.sharded,
            gathered=self.model.is_materialized,
            stale=stale,
            unsharding=unsharding,
            whole_main=self._whole_main,
        )

    def _make_current(self, path: WeightPath, streams: CommStreams | None) -> Waitable | None:
        """Follow ``path``; the compute weights are current once the returned handle is."""
        post_forward, self._post_forward = self._post_forward, None
        if path is WeightPath.CURRENT:
            return None
        self.freshness.installed()
        if path is WeightPath.GATHER:
            return self._gather(streams, post_forward)
        if path is WeightPath.REFRESH:
            self._refresh_compute_shard(streams)
            return None
        if path is WeightPath.REFRESH_AND_GATHER:
            self._refresh_compute_shard(streams)
            return self._gather(streams)
        return _install_whole(self, streams, gather=path is WeightPath.ENCODE_AND_GATHER)

    def _refresh_compute_shard(self, streams: CommStreams | None) -> None:
        """HFSDP: rebuild the compute shard from the ``dp_outer`` peers' updated sub-shards
        (encoding this rank's main sub-shard into its slot first); a no-op otherwise."""
        outer = self._outer_route
        if outer is None:
            return
        slot = self.cuts.sub_shard(self.model)
        if self.main is not None:
            with torch.no_grad():
                self.codec.encode(self.main.shard, slot)
        outer.all_gather_into(slot, self.model.shard, stream=streams).wait()

    def _gather(
        self, streams: CommStreams | None, post_forward: PostForwardShard | None = None
    ) -> Waitable:
        """All-gather ZeRO-3 weights straight into the unsharded buffer: over the smaller
        group from the slices kept after forward (``post_forward``), else over the shard group
        (this rank's slot encoded from the main shard first where no compute shard persists).
        """
        unsharded = self.model.materialize()
        if post_forward is not None:
            handle = post_forward.gather_into(unsharded, streams, self.all_gather_comm)
            return self._decoded(handle, unsharded, senders=post_forward.subgroup.size)
        if self.main is not None and not self.model.has_persistent_shard:
            encode_main(self.codec, self.offload, self.main.shard, self.model.shard, streams)
        handle = self.shard_route.all_gather_into(
            self.model.shard, unsharded, stream=streams, comm=self.all_gather_comm
        )
        return self._decoded(handle, unsharded, senders=self.topology.shard_size)

    def attach_root(self, root: GroupRoot, path_prefix: str) -> None:
        """Join ``root``, whose module holds this group's unit at ``path_prefix`` (e.g.
        "blocks.1."): errors then name the parameters in full, the reducer's too."""
        self.root, self.full_names = root, [path_prefix + name for name in self.names]
        if self.reducer is not None:
            self.reducer.names = self.full_names

    def _decoded(self, handle: CommHandle, gathered: torch.Tensor, *, senders: int) -> Waitable:
        """``handle``'s gather of ``gathered`` from ``senders`` ranks, decoded once landed."""
        landed: Waitable = handle
        if self.all_gather_comm is not None:
            sent = gathered.numel() // senders
            landed = _NamingNonFinite(handle, self.layout, self.full_names, sent)
        if not self.codec.decodes:
            return landed
        return _AfterLanding(landed, lambda: self.codec.decode(gathered))

    def reshard(self, onto: PostForwardGroup | None = None) -> None:
        """Free the unsharded weights; ``onto`` (after forward, FSDP2's int
        ``reshard_after_forward``) first keeps this rank's slice of them for backward."""
        if not self.model.sharded:
            return
        self._post_forward = None  # a plain reshard also drops one no backward came for
        gathered = self.model.unsharded
        if onto is not None and gathered is not None and onto.serves(self.topology.shard_group):
            if self._onto is None or self._onto.group is not onto.group:  # checked once
                self._onto = Route(onto.group, onto.transport)
            self._post_forward = PostForwardShard(gathered, self._onto)
        self.model.release()

    @property
    def gathers_into_its_only_copy(self) -> bool:
        """Whether this rank's slot of the gathered weights is its only copy of them (ZeRO-1/2
        with no main weights apart): a custom all-gather comm must leave it as it was, so
        it is put back once the gather lands."""
        return self.main is None and not self.model.sharded and not self._whole_main

    @property
    def post_forward_numel(self) -> int:
        """Elements of the gathered weights held between forward and backward (0: none)."""
        return 0 if self._post_forward is None else self._post_forward.numel

    def install_weights(self, streams: CommStreams | None = None) -> Waitable | None:
        """Bring the compute weights up to date with optimizer-updated weights."""
        return self._make_current(self._path(stale=True, unsharding=False), streams)

    # ----------------------------------------------------------------- gradients
    def mark_weights_dirty(self) -> None:
        """Say the optimizer-facing weights changed outside ``optimizer.step()`` (e.g. a load):
        the compute weights are re-installed at the next unshard."""
        self.freshness.mark_dirty()

    def clear_optimizer_grads(self, *, set_to_none: bool) -> None:
        """``optimizer.zero_grad``'s work on a decoupled gradient attribute (torch's own
        ``zero_grad`` does ``.grad``)."""
        if self.grads is not None and self.grads.decoupled:
            self.grads.clear(self.dist_params, set_to_none=set_to_none)

    def zero_main_grads(self) -> None:
        """Zero the reduced gradients in place, if the parameters still hold them."""
        if self.grads is not None:
            self.grads.zero_()
        if self.reducer is not None:
            self.reducer.drop_partial()

    def scale_main_grads(self, factor: float) -> None:
        """Multiply the reduced gradients in place, if the parameters still hold them."""
        if self.grads is not None and self.grads.storage is not None:
            self.grads.storage.mul_(factor)

    def grad_nan_flags(self) -> torch.Tensor:
        """One flag per parameter: 1 when its local reduced gradient holds NaN or Inf."""
        assert self.grads is not None
        return self.grads.nonfinite_flags().to(self.topology.device)  # host-offloaded: moved

    def settle_host_grads(self) -> None:
        """Host offload: wait until the reduced gradients copied home landed (the backward
        ended; an optimizer may read them next)."""
        if self.reducer is not None and self.reducer.landing is not None:
            self.reducer.landing.settle()


def broadcast_from_first_rank(group: ParameterGroup) -> None:
    """The optimizer-facing weights of data-parallel rank 0 on every rank: over the shard
    group where each rank holds them whole, then this rank's shard over the outer (HSDP)
    group; the compute weights are re-installed at the next unshard. Collective over both."""
    topology = group.topology
    source = group.stepped
    if not source.sharded and topology.shard_size > 1:
        first = dist.get_global_rank(topology.shard_group, 0)
        dist.broadcast(source.materialize(), first, group=topology.shard_group)
    outer = topology.outer_group
    if outer is not None and source.has_persistent_shard:
        dist.broadcast(source.shard, dist.get_global_rank(outer, 0), group=outer)
    group.mark_weights_dirty()


def _reducer(
    group: ParameterGroup, reduce_config: GradReduceConfig, grad_allocator: Allocator | None
) -> GradReducer:
    """The group's gradient reducer (a group without gradients has none)."""
    assert group.grads is not None
    return GradReducer(
        group.layout,
        group.grads,
        group.dist_params,
        topology=group.topology,
        strategy=group.strategy,
        reduce_dtype=group.wrap_reduce_dtype,
        reduce_config=reduce_config,
        allocator=grad_allocator or PlainAllocator(),
        names=group.names,
        landing=None if group.offload is None else GradLanding(group.offload),
    )


def _install_whole(
    group: ParameterGroup, streams: CommStreams | None, *, gather: bool
) -> Waitable | None:
    """Rebuild ``group``'s whole (never sharded: ZeRO-1/2) compute weights from the main
    weights: encoded here from the whole main weights, or (``gather``) from this rank's main
    shard into its slot, the other slots all-gathered."""
    full = group.model.materialize()
    if not gather:
        if group.main is not None:
            with torch.no_grad():
                group.codec.encode(group.main.materialize(), full)
                group.codec.decode(full)
        return None
    slot = group.model.shard
    if group.main is not None:
        encode_main(group.codec, group.offload, group.main.shard, slot, streams)
    custom = group.all_gather_comm is not None
    kept = slot.clone() if custom and group.gathers_into_its_only_copy else None
    handle = group.shard_route.all_gather_into(
        slot, full, stream=streams, comm=group.all_gather_comm
    )
    landed = group._decoded(handle, full, senders=group.topology.shard_size)
    if kept is None:
        return landed
    # What a custom comm wrote back into this rank's slot (a lossy one: its version of the
    # weights) must not replace the weights the optimizer steps.
    return _AfterLanding(landed, partial(slot.copy_, kept))
