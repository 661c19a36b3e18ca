"""How one parameter group's flat buffer is cut into shards, and this rank's views of them.

Two cuts of one packing: ``layout`` into the compute shards the shard group all-gathers, and
``optim_layout`` into the optimizer-facing shards (main weights, gradients, optimizer state).
Without HFSDP they are the same cut; under HFSDP the second has ``shard x outer`` sub-shards
and the first is it merged across ``dp_outer``, so a rank's sub-shard is a slice of its own
compute shard (``sub_shard``). The distributed parameters are row-sharded DTensors over
this rank's rows of the optimizer-facing shard, on the optimizer mesh, or for a TP parameter
(whose shape here is the TP-local one) on the ``(dp, tp)`` mesh. A parameter cut along
another dim than 0 (``shard_dims``) is stored with that dim first; its views and its DTensor
are in the user's dim order.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard

from mfsdp_buffers import DataParallelBuffer, FlatLayout
from mfsdp_collectives import FSDPTopology
from mfsdp_hooks.config.codec import CodecContext
from mfsdp_hooks.config.strategy import ShardingStrategy
from mfsdp_hooks.dtensor.dtensor_views import replicated_dtensor, sharded_dtensor
from mfsdp_hooks.dtensor.row_sharded import row_sharded
from mfsdp_hooks.dtensor.tensor_parallel import TPSpec, carry_attributes

__all__ = ["ShardCuts"]


class ShardCuts:
    """The compute and optimizer-facing cuts of one group, for this rank of ``topology``."""

    def __init__(
        self,
        shapes: Sequence[torch.Size],
        topology: FSDPTopology,
        *,
        alignment: int,
        tp_specs: Sequence[TPSpec | None] = (),
        shard_dims: Sequence[int] = (),
    ) -> None:
        self.shapes = list(shapes)
        self.shard_dims = list(shard_dims) or [0] * len(self.shapes)
        self.topology = topology
        self.tp_specs = list(tp_specs) or [None] * len(self.shapes)
        self._dp_tp_meshes = {id(s.mesh): topology.with_tp(s.mesh) for s in self.tp_specs if s}
        self._optim_indices: dict[int, tuple[int, ...]] = {}
        self.optim_layout = FlatLayout.build(
            self.shapes,
            world_size=topology.optim_size,
            alignment=alignment,
            shard_dims=self.shard_dims,
        )
        self.layout = self.optim_layout.merged(topology.optim_size // topology.shard_size)
        self.optim_rank = topology.optim_rank

    def codec_context(self, compute_dtype: torch.dtype) -> CodecContext:
        """What a codec encodes from: this rank's main-weight shard. Under HFSDP that is a
        ``dp_shard x dp_outer`` sub-shard, encoded into its slot of the compute shard, with
        scales agreed over every rank holding a piece."""
        topology = self.topology
        if topology.shards_optimizer_across_outer:
            group = topology.optim_group if topology.optim_size > 1 else None
            return CodecContext(self.optim_layout, topology.optim_rank, group, compute_dtype)
        group = topology.shard_group if topology.shard_size > 1 else None
        return CodecContext(self.layout, topology.shard_rank, group, compute_dtype)

    def sub_shard(self, buffer: DataParallelBuffer) -> torch.Tensor:
        """This rank's optimizer-facing shard inside ``buffer``'s shard (a buffer of either
        cut): all of it, or under HFSDP its ``dp_outer`` slice of the compute shard."""
        start = self.optim_layout.shard_range(self.optim_rank)[0]
        start -= buffer.layout.shard_range(buffer.rank)[0]
        return buffer.shard[start : start + self.optim_layout.shard_numel]

    def local_rows(self, buffer: DataParallelBuffer, index: int) -> torch.Tensor:
        """This rank's optimizer-facing rows of parameter ``index`` in ``buffer``'s storage."""
        piece = self.optim_layout.local_piece(index, self.optim_rank)
        placement = self.optim_layout.placements[index]
        if buffer.sharded:
            flat = self.sub_shard(buffer)[piece.shard_offset : piece.shard_offset + piece.numel]
            return placement.rows_view(flat, piece.num_rows)
        buffer.materialize()
        return placement.rows_of(buffer.unsharded_view(index), piece.row_start, piece.row_end)

    def dtensor(self, local: torch.Tensor, index: int, *, sharded: bool) -> torch.Tensor:
        """Parameter ``index``'s DTensor over ``local`` (this rank's rows of it, or all of it
        when not ``sharded``): its original global shape, on the optimizer mesh, or with TP on
        the ``(dp, tp)`` mesh."""
        spec = self.tp_specs[index]
        mesh = self.topology.optim_mesh
        assert mesh is not None, "FSDPTopology without a shard mesh cannot build DTensors"
        if spec is None:
            if not sharded:
                return replicated_dtensor(local, mesh)
            placement = Shard(self.shard_dims[index])
            tensor = sharded_dtensor(local, mesh, self.shapes[index], (placement,))
            return row_sharded(tensor, self.row_ranges(index, mesh))
        placements = [Shard(0) if sharded else Replicate(), *spec.placements]
        dp_tp = self._dp_tp_meshes[id(spec.mesh)]
        tensor = sharded_dtensor(local, dp_tp, spec.global_shape, placements)
        if not sharded:
            return tensor
        ranges = self.row_ranges(index, dp_tp)
        return row_sharded(tensor, ranges, tp_partition_stride=spec.partition_stride)

    def row_ranges(self, index: int, mesh: DeviceMesh) -> tuple[tuple[int, int], ...]:
        """The rows of parameter ``index`` held at each coordinate of ``mesh``'s dim 0 (the
        optimizer mesh, or a ``(dp, tp)`` mesh whose dp coordinates under HFSDP are not
        sub-shard order)."""
        indices = self._optim_indices.get(id(mesh))
        if indices is None:
            indices = self._optim_indices[id(mesh)] = self.topology.optim_indices_along(mesh)
        every_rank = self.optim_layout.row_ranges(index)
        return tuple(every_rank[i] for i in indices)

    def dist_params(
        self,
        buffer: DataParallelBuffer,
        strategy: ShardingStrategy,
        *,
        originals: Sequence[nn.Parameter],
    ) -> list[nn.Parameter]:
        """One parameter per original parameter: its DTensor over ``buffer`` (row-sharded;
        replicated for ``no_shard``), sharing its storage, with the original's
        ``requires_grad`` and public attributes."""
        params = []
        for index, original in enumerate(originals):
            if strategy == ShardingStrategy.NO_SHARD:
                buffer.materialize()
                tensor = self.dtensor(buffer.unsharded_view(index), index, sharded=False)
            else:
                tensor = self.dtensor(self.local_rows(buffer, index), index, sharded=True)
            param = nn.Parameter(tensor, requires_grad=original.requires_grad)
            carry_attributes(original, param)
            params.append(param)
        return params
