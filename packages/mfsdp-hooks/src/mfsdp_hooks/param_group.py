"""One FSDP unit's parameters of one dtype: their flat buffers and the parameters users see.

A ``ParameterGroup`` owns, laid out by one ``FlatLayout``:

* model weights in the compute dtype: sharded for ZeRO-3 (nothing persists when fp32 main
  weights exist: the main shard is cast in before each gather), whole otherwise;
* main weights in the optimizer dtype, only when that differs from the compute dtype;
* reduced gradients in the optimizer dtype (a ``GradShard``): sharded for ZeRO-1/2/3, whole
  for ``no_shard``, owned by the distributed parameters' ``.grad``.

Under HFSDP (``topology.shards_optimizer_across_outer``) two layouts cut the same packing:
``layout`` into the ``dp_shard`` compute shards, which persist and are all-gathered for
forward and backward, and ``optim_layout`` into ``dp_shard x dp_outer`` sub-shards for the
main weights, the gradients and the optimizer state. After a step, the sub-shards are
all-gathered across ``dp_outer`` into the compute shard once (``_refresh_compute_shard``).

It also owns two sets of ``nn.Parameter`` objects created once: the unsharded parameters
(zero-copy views into the unsharded model-weight buffer, used by forward and backward) and
the distributed parameters (DTensors of the original shapes over the optimizer-facing shard,
seen by the optimizer and by ``state_dict``). The group is the weight side: sharded <->
unsharded, and installing optimizer-updated weights. Its gradients are collected and
reduced by its ``GradReducer`` (``grad_reducer``), into the ``GradShard`` it owns.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

import torch
from torch import nn

from mfsdp_buffers import (
    Allocator,
    BufferRole,
    DataParallelBuffer,
    PlainAllocator,
)
from mfsdp_collectives import (
    CommHandle,
    CommStreams,
    FSDPTopology,
    all_gather_into,
)
from mfsdp_hooks.codec import IDENTITY, ParamCodec
from mfsdp_hooks.grad_reducer import GradReducer
from mfsdp_hooks.grad_shard import GradShard
from mfsdp_hooks.mixed_precision import MixedPrecisionPolicy
from mfsdp_hooks.reduce_config import GradReduceConfig
from mfsdp_hooks.root_protocol import GroupRoot
from mfsdp_hooks.shard_cuts import ShardCuts
from mfsdp_hooks.strategy import ShardingStrategy
from mfsdp_hooks.tensor_parallel import local_value, tp_spec_of, unsharded_param
from mfsdp_hooks.weight_freshness import WeightFreshness

DEFAULT_ALIGNMENT = 16


class Waitable(Protocol):
    """What an unshard hands back: ``wait()`` before using the compute weights."""

    def wait(self) -> None: ...


class _DecodeAfter:
    """A gather whose codec rebuilds the compute weights once it has landed."""

    def __init__(self, handle: CommHandle, decode: Callable[[], None]) -> None:
        self._handle = handle
        self._decode: Callable[[], None] | None = decode

    def wait(self) -> None:
        self._handle.wait()
        decode, self._decode = self._decode, None
        if decode is not None:
            with torch.no_grad():
                decode()


class ParameterGroup:
    """The parameters of one FSDP unit that share dtype and ``requires_grad``."""

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
    ) -> None:
        self.names = list(names)
        self.root: GroupRoot | None = None
        self.topology = topology
        self.strategy = strategy
        self.requires_grad = params[0].requires_grad
        self.original_dtype = params[0].dtype
        # Tensor parallelism: the TP-local tensors are what FSDP flattens and shards.
        self.tp_specs = [tp_spec_of(p, topology.tp_mesh) for p in params]
        values = [local_value(p) for p in params]
        self.shapes = [v.shape for v in values]
        for name, shape in zip(self.names, self.shapes, strict=True):
            if len(shape) == 0:
                raise ValueError(
                    f"parameter {name!r} is 0-d and cannot be sharded: reshape it to (1,)"
                )
        self.cuts = ShardCuts(self.shapes, topology, alignment=alignment, tp_specs=self.tp_specs)
        self.layout, self.optim_layout = self.cuts.layout, self.cuts.optim_layout
        self.compute_dtype = policy.compute_dtype(self.original_dtype)
        self.reduce_dtype = policy.grad_reduce_dtype(self.original_dtype)
        optimizer_dtype = policy.optimizer_dtype(self.original_dtype)
        self.model, self.main = self._weight_buffers(optimizer_dtype)
        if codec is not IDENTITY and self.main is None:
            raise NotImplementedError(
                f"param_codec={type(codec).__name__} for {names[0]!r} needs main weights apart "
                f"from the compute weights, but both are {self.compute_dtype}: pass a "
                "MixedPrecisionPolicy whose param_dtype differs from main_params_dtype"
            )
        self.codec = codec
        self.grads: GradShard | None = None
        if self.requires_grad:
            self.grads = self._grad_shard(policy.grad_dtype(self.original_dtype), optimizer_dtype)
        self._fill_buffers(values)
        self.unsharded_params = self._adopt_params(params)
        self.dist_params = self.cuts.dist_params(
            self.main if self.main is not None else self.model, strategy, originals=params
        )
        self.freshness = WeightFreshness(steppable=self.requires_grad)
        if topology.shards_optimizer_across_outer and codec is not IDENTITY:
            self.freshness.mark_dirty()  # the kept compute shard was cast in, not encoded
        self.reducer: GradReducer | None = None
        if self.grads is not None:
            self.reducer = GradReducer(
                self.layout,
                self.grads,
                self.dist_params,
                topology=topology,
                strategy=strategy,
                reduce_dtype=self.reduce_dtype,
                reduce_config=reduce_config,
                allocator=grad_allocator or PlainAllocator(),
            )

    # ----------------------------------------------------------------- construction
    def _weight_buffers(
        self, optimizer_dtype: torch.dtype
    ) -> tuple[DataParallelBuffer, DataParallelBuffer | None]:
        """The compute-dtype model weights, and main weights when the optimizer's dtype differs
        (under ZeRO-3 with main weights no compute-dtype shard persists)."""
        rank, strategy, name = self.topology.shard_rank, self.strategy, self.names[0]
        # HFSDP keeps the compute shard: rebuilding it costs an all-gather across dp_outer.
        rebuilt = strategy.shards_params and optimizer_dtype != self.compute_dtype
        model = DataParallelBuffer(
            self.layout,
            rank,
            dtype=self.compute_dtype,
            device=self.topology.device,
            role=BufferRole.MODEL_WEIGHT,
            sharded=strategy.shards_params,
            name=f"{name}:model",
            persistent_shard=not rebuilt or self.topology.shards_optimizer_across_outer,
        )
        if optimizer_dtype == self.compute_dtype:
            return model, None
        main = DataParallelBuffer(
            self.optim_layout,
            self.topology.optim_rank,
            dtype=optimizer_dtype,
            device=self.topology.device,
            role=BufferRole.MAIN_WEIGHT,
            sharded=strategy.shards_optimizer_state,
            name=f"{name}:main",
        )
        return model, main

    def _grad_shard(self, grad_dtype: torch.dtype, optimizer_dtype: torch.dtype) -> GradShard:
        if grad_dtype != optimizer_dtype:
            raise NotImplementedError(
                f"MixedPrecisionPolicy.main_grads_dtype={grad_dtype} differs from the "
                f"optimizer weights' dtype {optimizer_dtype} for {self.names[0]!r}: optimizers "
                "need gradients in the dtype of their parameters; leave main_grads_dtype None"
            )
        return GradShard(
            self.optim_layout,
            self.topology.optim_rank,
            dtype=grad_dtype,
            device=self.topology.device,
            sharded=self.strategy.shards_optimizer_state,
            make_dtensor=self.cuts.dtensor,
        )

    def _fill_buffers(self, values: Sequence[torch.Tensor]) -> None:
        with torch.no_grad():
            if self.model.has_persistent_shard:
                self.model.copy_params_in(values)
            if self.main is not None:
                self.main.copy_params_in(values)

    def _adopt_params(self, params: Sequence[nn.Parameter]) -> list[nn.Parameter]:
        """Point the user's parameters at the unsharded buffer, freeing their own storage.

        Keeping the same ``nn.Parameter`` objects preserves every outside reference to them
        (an optimizer built before wrapping, tied weights, user code). A tensor-parallel
        parameter becomes a new DTensor over the buffer (a DTensor's local tensor cannot be
        swapped in place), as FSDP2 replaces its parameters.
        """
        self.model.materialize()
        adopted = []
        for index, (param, spec) in enumerate(zip(params, self.tp_specs, strict=True)):
            view = self.model.unsharded_view(index)
            if spec is None or not spec.computes_as_dtensor:
                param.data = view
            else:
                param = unsharded_param(view, spec, requires_grad=param.requires_grad)
            adopted.append(param)
        if self.model.sharded:
            self.model.release()
        return adopted

    # ----------------------------------------------------------------- weights
    @property
    def is_unsharded(self) -> bool:
        return self.model.is_materialized

    def unshard(self, streams: CommStreams | None = None) -> Waitable | None:
        """Start making the unsharded weights current; wait on the returned handle before use."""
        if self.model.sharded:
            if self.model.is_materialized and not self.freshness.dirty:
                return None
            if self.freshness.dirty:
                self._refresh_compute_shard(streams)
            self.freshness.dirty = False
            return self._gather(streams)
        if self.freshness.dirty:
            return self.install_weights(streams)
        return None

    def _refresh_compute_shard(self, streams: CommStreams | None) -> None:
        """HFSDP: rebuild the compute shard from the ``dp_outer`` peers' updated sub-shards
        (encoding this rank's main sub-shard into its slot first); a no-op otherwise."""
        outer = self.topology.outer_group
        if not self.topology.shards_optimizer_across_outer or outer is None:
            return
        slot = self.cuts.sub_shard(self.model)
        if self.main is not None:
            with torch.no_grad():
                self.codec.encode(self.main.shard, slot)
        transport = self.topology.outer_transport
        all_gather_into(slot, self.model.shard, outer, stream=streams, transport=transport).wait()

    def _gather(self, streams: CommStreams | None) -> Waitable:
        """All-gather ZeRO-3 weights straight into the unsharded buffer.

        With separate main weights (and no HFSDP) nothing of the compute dtype persists: this
        rank's slot of the unsharded buffer is filled by encoding the main shard, then
        gathered in place.
        """
        unsharded = self.model.materialize()
        if self.main is not None and not self.model.has_persistent_shard:
            with torch.no_grad():
                self.codec.encode(self.main.shard, self.model.shard)
        handle = all_gather_into(
            self.model.shard,
            unsharded,
            self.topology.shard_group,
            stream=streams,
            transport=self.topology.host_transport,
        )
        return self._decoded(handle, unsharded)

    def _decoded(self, handle: CommHandle, gathered: torch.Tensor) -> Waitable:
        if not self.codec.decodes:
            return handle
        return _DecodeAfter(handle, lambda: self.codec.decode(gathered))

    def reshard(self) -> None:
        if self.model.sharded:
            self.model.release()

    def install_weights(self, streams: CommStreams | None = None) -> Waitable | None:
        """Bring the compute weights up to date with optimizer-updated weights."""
        self.freshness.dirty = False
        if self.model.sharded:
            self._refresh_compute_shard(streams)
            return self._gather(streams) if self.model.is_materialized else None
        full = self.model.materialize()
        if self.strategy == ShardingStrategy.NO_SHARD or self.topology.shard_size == 1:
            if self.main is not None:
                with torch.no_grad():
                    self.codec.encode(self.main.materialize(), full)
                    self.codec.decode(full)
            return None
        slot = self.model.shard
        if self.main is not None:
            with torch.no_grad():
                self.codec.encode(self.main.shard, slot)
        handle = all_gather_into(
            slot,
            full,
            self.topology.shard_group,
            stream=streams,
            transport=self.topology.host_transport,
        )
        return self._decoded(handle, full)

    # ----------------------------------------------------------------- gradients
    def mark_weights_dirty(self) -> None:
        """Say the optimizer-facing weights changed outside ``optimizer.step()`` (e.g. a load):
        the compute weights are re-installed at the next unshard."""
        self.freshness.mark_dirty()

    def zero_main_grads(self) -> None:
        """Zero the reduced gradients in place, if the parameters still hold them."""
        if self.grads is not None:
            self.grads.zero_()
        if self.reducer is not None:
            self.reducer.drop_partial()

    def grad_nan_flags(self) -> torch.Tensor:
        """One flag per parameter: 1 when its local reduced gradient holds NaN or Inf."""
        assert self.grads is not None
        return self.grads.nonfinite_flags()
