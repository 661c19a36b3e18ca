"""One FSDP unit's parameters of one dtype: their flat buffers and the parameters users see.

A ``ParameterGroup`` owns, laid out by one ``FlatLayout``:

* model weights in the compute dtype: sharded for ZeRO-3 (nothing persists when fp32 main
  weights exist: the main shard is cast in before each gather), whole otherwise;
* main weights in the optimizer dtype, only when that differs from the compute dtype;
* reduced gradients in the optimizer dtype (a ``GradShard``): sharded for ZeRO-1/2/3, whole
  for ``no_shard``, owned by the distributed parameters' ``.grad``.

It also owns two sets of ``nn.Parameter`` objects created once: the unsharded parameters
(zero-copy views into the unsharded model-weight buffer, used by forward and backward) and
the distributed parameters (DTensors of the original shapes over the optimizer-facing shard,
seen by the optimizer and by ``state_dict``). Gradients leave through one collective per
group. Where the shared-memory host transport carries the reduce-scatter, the group keeps
autograd's per-parameter gradients and the transport reads them in place (``FlatPieces``);
elsewhere they are copied on arrival into a temporary unsharded buffer in the reduce dtype.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from mfsdp_buffers import (
    Allocator,
    BufferRole,
    DataParallelBuffer,
    FlatLayout,
    FlatPieces,
    PlainAllocator,
)
from mfsdp_collectives import (
    CommHandle,
    CommStreams,
    FSDPTopology,
    all_gather_into,
    all_reduce_,
    host_transport_of,
    reduce_scatter_into,
)
from mfsdp_hooks.dtensor_views import replicated_dtensor, sharded_dtensor
from mfsdp_hooks.grad_allocator import pools_memory
from mfsdp_hooks.grad_shard import GradShard
from mfsdp_hooks.mixed_precision import MixedPrecisionPolicy
from mfsdp_hooks.reduce_config import GradReduceConfig
from mfsdp_hooks.root_protocol import GroupRoot
from mfsdp_hooks.strategy import ShardingStrategy

DEFAULT_ALIGNMENT = 16


@dataclass
class PendingReduction:
    """A gradient reduction in flight and what to do once it lands."""

    group: ParameterGroup
    handle: CommHandle
    finish_no_shard: bool
    done: bool = False

    def wait(self) -> None:
        if self.done:
            return
        self.done = True
        self.handle.wait()
        self.group.finish_reduction(self.finish_no_shard)


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
    ) -> None:
        self.names = list(names)
        self.root: GroupRoot | None = None
        self.topology = topology
        self.strategy = strategy
        self.requires_grad = params[0].requires_grad
        self.original_dtype = params[0].dtype
        self.shapes = [p.shape for p in params]
        for name, shape in zip(self.names, self.shapes, strict=True):
            if len(shape) == 0:
                raise ValueError(
                    f"parameter {name!r} is 0-d and cannot be sharded: reshape it to (1,)"
                )
        device = topology.device
        rank, world = topology.shard_rank, topology.shard_size
        self.layout = FlatLayout.build(self.shapes, world_size=world, alignment=alignment)
        self.compute_dtype = policy.compute_dtype(self.original_dtype)
        self.reduce_dtype = policy.grad_reduce_dtype(self.original_dtype)
        optimizer_dtype = policy.optimizer_dtype(self.original_dtype)
        self.model = DataParallelBuffer(
            self.layout,
            rank,
            dtype=self.compute_dtype,
            device=device,
            role=BufferRole.MODEL_WEIGHT,
            sharded=strategy.shards_params,
            name=f"{names[0]}:model",
            persistent_shard=not (strategy.shards_params and optimizer_dtype != self.compute_dtype),
        )
        self.main: DataParallelBuffer | None = None
        if optimizer_dtype != self.compute_dtype:
            self.main = DataParallelBuffer(
                self.layout,
                rank,
                dtype=optimizer_dtype,
                device=device,
                role=BufferRole.MAIN_WEIGHT,
                sharded=strategy.shards_optimizer_state,
                name=f"{names[0]}:main",
            )
        self.grads: GradShard | None = None
        if self.requires_grad:
            grad_dtype = policy.grad_dtype(self.original_dtype)
            if grad_dtype != optimizer_dtype:
                raise NotImplementedError(
                    f"MixedPrecisionPolicy.main_grads_dtype={grad_dtype} differs from the "
                    f"optimizer weights' dtype {optimizer_dtype} for {names[0]!r}: optimizers "
                    "need gradients in the dtype of their parameters; leave main_grads_dtype None"
                )
            assert topology.shard_mesh is not None, "FSDPTopology without a shard mesh"
            self.grads = GradShard(
                self.layout,
                rank,
                dtype=grad_dtype,
                device=device,
                sharded=strategy.shards_optimizer_state,
                mesh=topology.shard_mesh,
            )
        self._grad_allocator: Allocator = grad_allocator or PlainAllocator()
        # Per-parameter gradients are kept as they arrive when the reduce-scatter can read
        # them in place; a pre-scale then becomes the same post-scale on the output shard.
        self._held: list[torch.Tensor | None] | None = None
        in_place = (
            device.type == "cpu"
            and strategy != ShardingStrategy.NO_SHARD
            and not pools_memory(self._grad_allocator)
            and host_transport_of(topology.shard_group) is not None
        )
        native_average = in_place or dist.get_backend(topology.shard_group) != "gloo"
        self._average, self._input_scale = reduce_config.collective_args(
            topology.shard_size, native_average
        )
        self._output_scale: float | None = None
        if in_place:
            self._held = [None] * len(self.shapes)
            self._output_scale, self._input_scale = self._input_scale, None
        self._fill_buffers(params)
        self.unsharded_params = self._adopt_params(params)
        self.dist_params = self._make_dist_params()
        self._gaps = self._padding_gaps()
        self._grad_buffer: torch.Tensor | None = None
        self._grad_filled = [False] * len(self.shapes)
        self.weights_dirty = False
        self.pending: PendingReduction | None = None
        self._no_shard_target: tuple[torch.Tensor, bool] | None = None
        self.grads_received = 0
        self.expected_grads = len(self.shapes) if self.requires_grad else 0

    # ----------------------------------------------------------------- construction
    def _fill_buffers(self, params: Sequence[nn.Parameter]) -> None:
        with torch.no_grad():
            if self.model.has_persistent_shard:
                self.model.copy_params_in([p.detach() for p in params])
            if self.main is not None:
                self.main.copy_params_in([p.detach() for p in params])

    def _adopt_params(self, params: Sequence[nn.Parameter]) -> list[nn.Parameter]:
        """Point the user's parameters at the unsharded buffer, freeing their own storage.

        Keeping the same ``nn.Parameter`` objects preserves every outside reference to them
        (an optimizer built before wrapping, tied weights, user code).
        """
        self.model.materialize()
        for index, param in enumerate(params):
            param.data = self.model.unsharded_view(index)
        if self.model.sharded:
            self.model.release()
        return list(params)

    def _optimizer_buffer(self) -> DataParallelBuffer:
        return self.main if self.main is not None else self.model

    def _local_rows(self, buffer: DataParallelBuffer, index: int) -> torch.Tensor:
        """This rank's rows of parameter ``index`` inside ``buffer``'s persistent storage."""
        if buffer.sharded:
            return buffer.local_view(index)
        buffer.materialize()
        piece = self.layout.local_piece(index, self.topology.shard_rank)
        return buffer.unsharded_view(index)[piece.row_start : piece.row_end]

    def _make_dtensor(self, buffer: DataParallelBuffer, index: int) -> torch.Tensor:
        mesh = self.topology.shard_mesh
        assert mesh is not None, "FSDPTopology without a shard mesh cannot build DTensors"
        if self.strategy == ShardingStrategy.NO_SHARD:
            buffer.materialize()
            return replicated_dtensor(buffer.unsharded_view(index), mesh)
        return sharded_dtensor(self._local_rows(buffer, index), mesh, self.shapes[index])

    def _make_dist_params(self) -> list[nn.Parameter]:
        buffer = self._optimizer_buffer()
        return [
            nn.Parameter(self._make_dtensor(buffer, i), requires_grad=self.requires_grad)
            for i in range(len(self.shapes))
        ]

    def _padding_gaps(self) -> list[tuple[int, int]]:
        gaps, cursor = [], 0
        for placement in self.layout.placements:
            if placement.offset > cursor:
                gaps.append((cursor, placement.offset))
            cursor = max(cursor, placement.offset + placement.numel)
        if cursor < self.layout.padded_numel:
            gaps.append((cursor, self.layout.padded_numel))
        return gaps

    # ----------------------------------------------------------------- weights
    @property
    def is_unsharded(self) -> bool:
        return self.model.is_materialized

    def unshard(self, streams: CommStreams | None = None) -> CommHandle | None:
        """Start making the unsharded weights current; wait on the returned handle before use."""
        if self.model.sharded:
            if self.model.is_materialized and not self.weights_dirty:
                return None
            self.weights_dirty = False
            return self._gather(streams)
        if self.weights_dirty:
            return self.install_weights(streams)
        return None

    def _gather(self, streams: CommStreams | None) -> CommHandle:
        """All-gather ZeRO-3 weights straight into the unsharded buffer.

        With separate main weights nothing of the compute dtype persists: this rank's slot of
        the unsharded buffer is filled by casting the main shard, then gathered in place.
        """
        unsharded = self.model.materialize()
        if self.main is not None:
            with torch.no_grad():
                self.model.shard.copy_(self.main.shard)
        return all_gather_into(
            self.model.shard, unsharded, self.topology.shard_group, async_op=True, stream=streams
        )

    def reshard(self) -> None:
        if self.model.sharded:
            self.model.release()

    def install_weights(self, streams: CommStreams | None = None) -> CommHandle | None:
        """Bring the compute weights up to date with optimizer-updated weights."""
        self.weights_dirty = False
        if self.model.sharded:
            return self._gather(streams) if self.model.is_materialized else None
        full = self.model.materialize()
        if self.strategy == ShardingStrategy.NO_SHARD or self.topology.shard_size == 1:
            if self.main is not None:
                with torch.no_grad():
                    full.copy_(self.main.materialize())
            return None
        slot = self.model.shard
        if self.main is not None:
            with torch.no_grad():
                slot.copy_(self.main.shard)
        return all_gather_into(slot, full, self.topology.shard_group, async_op=True, stream=streams)

    # ----------------------------------------------------------------- gradients
    def begin_backward(self) -> None:
        self.grads_received = 0

    def accumulate_grad(self, index: int, grad: torch.Tensor) -> bool:
        """Take one parameter's unsharded gradient (kept, or added into the reduce buffer).

        Returns True when every gradient of the group has arrived in this backward.
        """
        if self.pending is not None:
            self.pending.wait()
        if self._held is not None:
            self._hold_grad(index, grad.reshape(-1))
        else:
            self._copy_grad_in(index, grad.reshape(-1))
        self.grads_received += 1
        return self.grads_received >= self.expected_grads

    def _hold_grad(self, index: int, flat_grad: torch.Tensor) -> None:
        """Keep autograd's gradient itself (the caller dropped ``param.grad``: it is ours)."""
        assert self._held is not None
        held = self._held[index]
        if held is None:
            self._held[index] = flat_grad
            return
        if held.dtype != self.reduce_dtype:
            held = held.to(self.reduce_dtype)
        with torch.no_grad():
            self._held[index] = held.add_(flat_grad)

    def _copy_grad_in(self, index: int, flat_grad: torch.Tensor) -> None:
        if self._grad_buffer is None:
            self._grad_buffer = self._grad_allocator.allocate(
                ("grad", id(self)), self.layout.padded_numel, self.reduce_dtype, self.model.device
            )
        placement = self.layout.placements[index]
        slot = self._grad_buffer[placement.offset : placement.offset + placement.numel]
        scale = self._input_scale
        with torch.no_grad():
            # A pre-scale (1/N, gradient_scaling_factor) rides on the copy we make anyway,
            # instead of a separate scaled copy of the whole bucket before the collective.
            if self._grad_filled[index]:
                slot.add_(flat_grad, alpha=1.0 if scale is None else scale)
            elif scale is None:
                slot.copy_(flat_grad)
            else:
                torch.mul(flat_grad, scale, out=slot)
            self._grad_filled[index] = True

    @property
    def has_local_grads(self) -> bool:
        if self._held is not None:
            return any(g is not None for g in self._held)
        return self._grad_buffer is not None

    def _held_pieces(self) -> FlatPieces:
        assert self._held is not None
        return FlatPieces(
            self.layout.padded_numel,
            [
                (self.layout.placements[i].offset, grad)
                for i, grad in enumerate(self._held)
                if grad is not None
            ],
            dtype=self.reduce_dtype,
            device=self.model.device,
        )

    def _complete_grad_buffer(self) -> torch.Tensor:
        """The reduce buffer with padding and missing gradients zeroed."""
        if self._grad_buffer is None:
            self._grad_buffer = self._grad_allocator.allocate(
                ("grad", id(self)), self.layout.padded_numel, self.reduce_dtype, self.model.device
            )
        buffer = self._grad_buffer
        with torch.no_grad():
            for start, end in self._gaps:
                buffer[start:end].zero_()
            for index, filled in enumerate(self._grad_filled):
                if not filled:
                    placement = self.layout.placements[index]
                    buffer[placement.offset : placement.offset + placement.numel].zero_()
        return buffer

    def reduce_grads(self, streams: CommStreams | None = None) -> PendingReduction:
        """Issue this group's gradient reduction into the gradients the optimizer reads."""
        assert self.grads is not None, "frozen parameter groups have no gradients to reduce"
        if self.pending is not None:
            self.pending.wait()
        target, accumulate = self.grads.prepare(self.dist_params)
        if self.strategy == ShardingStrategy.NO_SHARD:  # never held: no transport all-reduce
            self._no_shard_target = (target, accumulate)
            handle = all_reduce_(
                self._complete_grad_buffer(),
                self.topology.shard_group,
                average=self._average,
                async_op=True,
                stream=streams,
            )
            self.pending = PendingReduction(self, handle, finish_no_shard=True)
            return self.pending
        grads = self._held_pieces() if self._held is not None else self._complete_grad_buffer()
        handle = reduce_scatter_into(
            grads,
            target,
            self.topology.shard_group,
            average=self._average,
            post_scale=self._output_scale,
            accumulate=accumulate,
            async_op=True,
            stream=streams,
        )
        self.pending = PendingReduction(self, handle, finish_no_shard=False)
        return self.pending

    def finish_reduction(self, no_shard: bool) -> None:
        self.pending = None
        if self._held is not None:
            self._held = [None] * len(self.shapes)
            return
        buffer = self._grad_buffer
        assert buffer is not None
        if no_shard:
            assert self._no_shard_target is not None
            target, accumulate = self._no_shard_target
            self._no_shard_target = None
            with torch.no_grad():
                if accumulate:
                    target.add_(buffer)
                else:
                    target.copy_(buffer)
        self._grad_allocator.free(("grad", id(self)), buffer)
        self._grad_buffer = None
        self._grad_filled = [False] * len(self.shapes)
        self.pending = None

    def mark_weights_dirty(self) -> None:
        """Say the optimizer-facing weights changed outside ``optimizer.step()`` (e.g. a load):
        the compute weights are re-installed at the next unshard."""
        self.weights_dirty = True

    def zero_main_grads(self) -> None:
        """Zero the reduced gradients in place, if the parameters still hold them."""
        if self.grads is not None:
            self.grads.zero_()

    def grad_nan_flags(self) -> torch.Tensor:
        """One flag per parameter: 1 when its local reduced gradient holds NaN or Inf."""
        assert self.grads is not None
        return self.grads.nonfinite_flags()
