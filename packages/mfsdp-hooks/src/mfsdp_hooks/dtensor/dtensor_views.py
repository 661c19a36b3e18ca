"""DTensors of a parameter's original shape over zero-copy views into flat buffers: each
rank's piece is a row range, maybe uneven or empty, which ``DTensor.from_local`` with an
explicit global shape and stride accepts (:mod:`.row_sharded` makes gathering it exact)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard
from torch.distributed.tensor._dtensor_spec import DTensorSpec

from mfsdp_hooks.dtensor.row_sharded import RowShardedDTensor, new_row_sharded, row_sharded


def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor this rank holds: a DTensor's local tensor itself (not an autograd alias of
    it, so storage and version checks see the real one), any other tensor as it is."""
    return tensor._local_tensor if isinstance(tensor, DTensor) else tensor


def contiguous_stride(shape: torch.Size) -> tuple[int, ...]:
    stride: list[int] = []
    running = 1
    for size in reversed(shape):
        stride.append(running)
        running *= max(size, 1)
    return tuple(reversed(stride))


def sharded_dtensor(
    local: torch.Tensor,
    mesh: DeviceMesh,
    shape: torch.Size,
    placements: Sequence[Placement] = (Shard(0),),
) -> DTensor:
    """A DTensor of global ``shape`` whose local tensor *is* ``local`` (no copy): row-sharded
    over a 1-D mesh unless other ``placements`` are given (a (dp, tp) mesh)."""
    with torch.no_grad():
        return DTensor.from_local(
            local,
            mesh,
            list(placements),
            run_check=False,
            shape=shape,
            stride=contiguous_stride(shape),
        )


def dtensor_like(local: torch.Tensor, like: DTensor) -> DTensor:
    """A DTensor with ``like``'s mesh, placements, global shape and (for a
    :class:`RowShardedDTensor`) row ranges whose local tensor is ``local`` (no copy): state,
    gradients or loaded values laid out as a parameter."""
    layout = DTensorLayout.of(like)
    meta = like._spec.tensor_meta
    if layout.fits(local) and meta is not None and meta.stride == contiguous_stride(like.shape):
        return layout.over(local)  # like's own spec: none to derive, no autograd function
    # The spec's placements, not a row-sharded one's RowShard: that is not ``local``'s.
    out = sharded_dtensor(local, like.device_mesh, like.shape, like._spec.placements)
    if not isinstance(like, RowShardedDTensor):
        return out
    return row_sharded(out, like.dp_row_ranges, tp_partition_stride=like.tp_partition_stride)


def replicated_dtensor(local: torch.Tensor, mesh: DeviceMesh) -> DTensor:
    with torch.no_grad():
        return DTensor.from_local(local, mesh, [Replicate()], run_check=False)


@dataclass(frozen=True)
class DTensorLayout:
    """How one DTensor lays out its local tensor (its spec and, row-sharded, its ranges),
    held without the tensor, to build the same DTensor over new storage again.

    A parameter's ``.grad`` is a new DTensor every step (the flat gradient storage is new
    after ``zero_grad()``); ``from_local`` re-derives and checks the spec through an autograd
    function each time, the largest host cost of a backward with many small parameters. The
    layout is taken once from a DTensor built that way and reused for the same local shape
    and dtype (FSDP2's ``_from_local_no_grad`` does the same with its cached spec).
    """

    spec: DTensorSpec
    local_shape: torch.Size
    row_ranges: tuple[tuple[int, int], ...] | None
    tp_partition_stride: int
    row_class: type[RowShardedDTensor] | None

    @classmethod
    def of(cls, tensor: DTensor) -> DTensorLayout:
        if isinstance(tensor, RowShardedDTensor):
            ranges, stride = tensor.dp_row_ranges, tensor.tp_partition_stride
            return cls(tensor._spec, tensor._local_tensor.shape, ranges, stride, type(tensor))
        return cls(tensor._spec, tensor._local_tensor.shape, None, 1, None)

    def fits(self, local: torch.Tensor) -> bool:
        """Whether ``local`` can be this layout's local tensor."""
        meta = self.spec.tensor_meta
        return local.shape == self.local_shape and meta is not None and local.dtype == meta.dtype

    def over(self, local: torch.Tensor) -> DTensor:
        """The DTensor of this layout whose local tensor is ``local`` (no copy, no grad)."""
        if self.row_class is None or self.row_ranges is None:
            return DTensor(local, self.spec, requires_grad=False)  # type: ignore[no-untyped-call]
        ranges, stride = self.row_ranges, self.tp_partition_stride
        return new_row_sharded(self.row_class, local, self.spec, ranges, stride)
