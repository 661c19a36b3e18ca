"""DTensors whose data-parallel shard is the flat layout's row range, not ``torch.chunk``'s.

The flat layout cuts each parameter where the buffer's shard edges fall, so each rank holds
a contiguous row range of it: uneven, often empty, under HFSDP not in mesh-rank order. A plain
``Shard(d)`` DTensor claims ``torch.chunk``'s split, and whatever gathers it would put rows in
the wrong place. :class:`RowShardedDTensor` is a plain DTensor in every op and also knows
every rank's rows along mesh dim 0 (``dp_row_ranges``, along ``dp_shard_dim``; on a
``(dp, tp)`` mesh, rows of the TP-local tensor: FSDP2's ``_StridedShard`` for a colwise
weight). ``redistribute`` (so ``full_tensor()``) gathers them exactly over mesh dim 0 first,
then follows torch's rules; DCP's chunks come from them too (:mod:`.dcp_protocol`).

What keeps the type: ``.data``, ``detach()``, ``clone()``, ``dtensor_like`` of one, and any
op whose first argument is one and whose result DTensor lays out as that argument (pointwise
ops, ``zeros_like``, ``full_like``, ``Tensor.to``), so a torch optimizer's state
(``exp_avg = zeros_like(param)``, SGD's momentum ``clone``) knows its parameter's rows. Other
results are plain DTensors: re-lay one out with ``dtensor_like(t.to_local(), param)``.
Elementwise ops among one layout run on the local tensors (:mod:`.local_elementwise`); there
is no Python ``__torch_function__``. Forward and backward never see these tensors.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata
from torch.distributed.checkpoint.planner import WriteItem
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard
from torch.distributed.tensor._dtensor_spec import DTensorSpec

from mfsdp_collectives import all_gather_into
from mfsdp_hooks.dtensor.dcp_protocol import row_chunks, row_write_items
from mfsdp_hooks.dtensor.local_elementwise import NOT_LOCAL, as_plain_dtensors, run_locally
from mfsdp_hooks.dtensor.row_placement import row_placements

__all__ = ["RowShardedDTensor", "new_row_sharded", "row_sharded"]

_TENSOR_DATA: Any = torch.Tensor.data  # the C getset descriptor behind ``Tensor.data``


class RowShardedDTensor(DTensor):
    """A DTensor sharded by rows over mesh dim 0 in the given, possibly uneven, counts."""

    dp_row_ranges: tuple[tuple[int, int], ...]
    """``[start, end)`` rows of the (TP-local) tensor that each rank of mesh dim 0 holds."""
    tp_partition_stride: int = 1
    """Megatron-Core's strided TP partition (``TPSpec.partition_stride``): the TP-local rows
    are this many blocks at several places of the full tensor (see :mod:`.dcp_protocol`)."""
    on_checkpoint_load: Callable[[], None] | None = None
    """Called when DCP plans a load into this tensor, i.e. its values are about to change in
    place (the engine re-installs the compute weights). Views of it (``.data``,
    ``detach()``) share it; copies and tensors laid out like it do not."""

    @classmethod
    def __torch_dispatch__(  # type: ignore[override]
        cls,
        func: torch._ops.OpOverload,
        types: Any,
        args: Sequence[Any] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        # An elementwise op among tensors of this one layout (an optimizer step) runs on
        # the local tensors; anything else goes to DTensor's dispatcher, as plain DTensors.
        out = run_locally(RowShardedDTensor, func, args, kwargs, _local_laid_out_as)
        if out is not NOT_LOCAL:
            return out
        kwargs = kwargs or {}
        plain = as_plain_dtensors(RowShardedDTensor, [*args, *kwargs.values()])
        result = func(*plain[: len(args)], **dict(zip(kwargs, plain[len(args) :], strict=True)))
        first = args[0] if args else None
        if not isinstance(first, RowShardedDTensor):
            return result
        if result is plain[0]:  # in place: the first argument is the result
            if result._spec != first._spec:
                # DTensor re-lays an in-place result out by changing its spec (squeeze_ of an
                # unsharded dim); the rows this tensor keeps would no longer be its rows.
                raise NotImplementedError(
                    f"{func}: an in-place op that moves a row-sharded DTensor's sharded dim is "
                    "not supported; apply it out of place to the tensor's full_tensor()"
                )
            return first
        if type(result) is DTensor and _same_layout(result, first):
            return _rewrap(result, first)  # laid out as the first argument: its rows too
        return result

    def __create_write_items__(self, fqn: str, object: Any) -> list[WriteItem]:
        return row_write_items(fqn, self, self.__create_chunks())

    def __create_chunk_list__(self) -> list[ChunkStorageMetadata]:
        chunks = self.__create_chunks()
        # A side effect in a query, on purpose: a plain ``dcp.load`` copies into the local
        # tensor in place and calls no load_state_dict hook, and DCP tells the tensor nothing
        # else that is load-only (``__get_tensor_shard__`` is asked on save too; the planner,
        # whose ``commit_tensor`` ends each read, is the user's). Only a load asks for chunks.
        if self.on_checkpoint_load is not None:
            self.on_checkpoint_load()
        return chunks

    def __create_chunks(self) -> list[ChunkStorageMetadata]:
        return row_chunks(self, self.dp_row_ranges, self.tp_partition_stride)

    @property
    def dp_shard_dim(self) -> int:
        """The tensor dim the ranges are along: that of the ``Shard`` on mesh dim 0."""
        placement = self.placements[0]
        assert isinstance(placement, Shard)
        return placement.dim

    @property
    def placements(self) -> tuple[Placement, ...]:
        """The spec's, with mesh dim 0's ``Shard`` telling torch's slicers our rows (a
        :class:`~.row_placement.RowShard`); the spec itself keeps the plain ``Shard``."""
        return row_placements(self, self.dp_row_ranges, self.tp_partition_stride)

    @property
    def data(self) -> RowShardedDTensor:
        return _view_of(_TENSOR_DATA.__get__(self), self)

    @data.setter
    def data(self, value: torch.Tensor) -> None:
        _TENSOR_DATA.__set__(self, value)

    def detach(self) -> RowShardedDTensor:
        return _view_of(super().detach(), self)

    def clone(self, *, memory_format: torch.memory_format | None = None) -> RowShardedDTensor:
        format = torch.preserve_format if memory_format is None else memory_format
        cloned = super().clone(memory_format=format)
        return _rewrap(cloned, self)

    def redistribute(
        self,
        device_mesh: DeviceMesh | None = None,
        placements: Sequence[Placement] | None = None,
        *,
        async_op: bool = False,
        forward_dtype: torch.dtype | None = None,
        backward_dtype: torch.dtype | None = None,
    ) -> DTensor:
        """Gather the rows over mesh dim 0 exactly, then let torch redistribute the rest.

        Not differentiable (a distributed parameter is an optimizer leaf, not an activation):
        the result never requires grad.
        """
        target = tuple(placements) if placements is not None else self.placements
        if (device_mesh is None or device_mesh == self.device_mesh) and target == self.placements:
            return self
        return self._gathered_over_dp().redistribute(
            device_mesh,
            target,
            async_op=async_op,
            forward_dtype=forward_dtype,
            backward_dtype=backward_dtype,
        )

    def _gathered_over_dp(self) -> DTensor:
        mesh = self.device_mesh
        with torch.no_grad():
            local = self._local_tensor.movedim(self.dp_shard_dim, 0)
            rows = _all_gather_rows(local, self.dp_row_ranges, mesh.get_group(0))
            rows = rows.movedim(0, self.dp_shard_dim).contiguous()
            return DTensor.from_local(
                rows,
                mesh,
                [Replicate(), *self.placements[1:]],
                run_check=False,
                shape=self.shape,
                stride=self.stride(),
            )


def row_sharded(
    tensor: DTensor, dp_row_ranges: Sequence[tuple[int, int]], *, tp_partition_stride: int = 1
) -> RowShardedDTensor:
    """``tensor`` (no copy) as a :class:`RowShardedDTensor` whose rank ``r`` of mesh dim 0
    holds rows ``dp_row_ranges[r]`` (of a strided TP partition: ``tp_partition_stride``).

    ``tensor`` must be ``Shard(d)`` on mesh dim 0; the ranges, one per rank of that dim, must
    tile dim ``d`` of the (TP-local) tensor, and this rank's local tensor must hold its range.
    """
    mesh = tensor.device_mesh
    ranges = (
        dp_row_ranges  # FlatLayout.row_ranges' own: a world of thousands is not copied per call
        if isinstance(dp_row_ranges, tuple)
        else tuple((int(start), int(end)) for start, end in dp_row_ranges)
    )
    placement = tensor.placements[0]
    if not isinstance(placement, Shard) or (placement.dim and len(tensor.placements) > 1):
        raise ValueError(
            f"row_sharded needs Shard(d) on mesh dim 0 (Shard(0) with a second mesh dim), "
            f"got {tensor.placements}"
        )
    if len(ranges) != mesh.size(0):
        raise ValueError(
            f"dp_row_ranges has {len(ranges)} ranges for a mesh dim 0 of {mesh.size(0)} ranks"
        )
    local = tensor._local_tensor
    start, end = ranges[mesh.get_local_rank(0)]
    if local.shape[placement.dim] != end - start:
        raise ValueError(
            f"this rank's local tensor has {local.shape[placement.dim]} rows along dim "
            f"{placement.dim}; dp_row_ranges gives it rows [{start}, {end})"
        )
    next_row = 0
    for start, end in sorted(r for r in ranges if r[0] != r[1]):
        if start != next_row or end < start:
            raise ValueError(f"dp_row_ranges {ranges} do not tile the rows from 0 without gaps")
        next_row = end
    return new_row_sharded(
        RowShardedDTensor,
        local,
        tensor._spec,
        ranges,
        tp_partition_stride,
        requires_grad=tensor.requires_grad,
    )


def _local_laid_out_as(local: torch.Tensor, like: RowShardedDTensor) -> RowShardedDTensor:
    """``local`` (no copy) as ``like``'s local tensor would be: same class, spec and rows."""
    return new_row_sharded(
        type(like), local, like._spec, like.dp_row_ranges, like.tp_partition_stride
    )


def _rewrap(tensor: torch.Tensor, like: RowShardedDTensor) -> RowShardedDTensor:
    """``tensor`` (no copy), laid out as ``like``, as a tensor of ``like``'s class."""
    assert isinstance(tensor, DTensor)
    ranges, stride = like.dp_row_ranges, like.tp_partition_stride
    local, spec, grad = tensor._local_tensor, tensor._spec, tensor.requires_grad
    return new_row_sharded(type(like), local, spec, ranges, stride, requires_grad=grad)


def new_row_sharded(
    cls: type[RowShardedDTensor],
    local: torch.Tensor,
    spec: DTensorSpec,
    ranges: tuple[tuple[int, int], ...],
    stride: int,
    *,
    requires_grad: bool = False,
) -> RowShardedDTensor:
    """The one constructor: a ``cls`` of ``spec`` over ``local`` (no copy, no checks) whose
    ranges are ``ranges``, of a TP partition of ``stride`` blocks."""
    out: RowShardedDTensor = cls(local, spec, requires_grad=requires_grad)
    out.dp_row_ranges = ranges
    if stride != 1:
        out.tp_partition_stride = stride
    return out


def _view_of(tensor: torch.Tensor, source: RowShardedDTensor) -> RowShardedDTensor:
    """``tensor``, a view of ``source``'s values, as ``source`` is (with its load callback)."""
    out = _rewrap(tensor, source)
    if source.on_checkpoint_load is not None:
        out.on_checkpoint_load = source.on_checkpoint_load
    return out


def _same_layout(out: DTensor, source: DTensor) -> bool:
    """Whether ``out`` is laid out as ``source``: same mesh, placements, shape and local shape."""
    return (
        out.shape == source.shape
        and out.placements == source.placements
        and out.device_mesh == source.device_mesh
        and out._local_tensor.shape == source._local_tensor.shape
    )


def _all_gather_rows(
    local: torch.Tensor, ranges: Sequence[tuple[int, int]], group: dist.ProcessGroup
) -> torch.Tensor:
    """Every rank's rows, each put at its range: one all-gather of equal padded pieces."""
    most = max(end - start for start, end in ranges)
    padded = local.new_zeros((most, *local.shape[1:]))
    padded[: local.shape[0]].copy_(local)
    gathered = local.new_empty((len(ranges) * most, *local.shape[1:]))
    all_gather_into(padded.view(-1), gathered.view(-1), group, async_op=False)
    rows = local.new_empty((max(end for _, end in ranges), *local.shape[1:]))
    for rank, (start, end) in enumerate(ranges):
        rows[start:end] = gathered[rank * most : rank * most + end - start]
    return rows
