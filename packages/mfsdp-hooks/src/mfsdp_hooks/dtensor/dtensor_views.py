"""DTensors of a parameter's original shape over zero-copy views into flat buffers.

The flat layout cuts parameters on row boundaries, so each rank's piece is a row range that
may be uneven or empty. ``DTensor.from_local`` with an explicit global shape and stride accepts
such pieces; :mod:`mfsdp_hooks.dtensor.row_sharded` makes gathering them exact, and the checkpoint
layer gives DCP the true row ranges from the layout.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard

from mfsdp_hooks.dtensor.row_sharded import RowShardedDTensor, row_sharded


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
    with torch.no_grad():
        out = DTensor.from_local(
            local,
            like.device_mesh,
            like._spec.placements,  # not a row-sharded one's RowShard: it is not ``local``'s
            run_check=False,
            shape=like.shape,
            stride=contiguous_stride(like.shape),
        )
    if not isinstance(like, RowShardedDTensor):
        return out
    return row_sharded(out, like.dp_row_ranges, tp_partition_stride=like.tp_partition_stride)


def replicated_dtensor(local: torch.Tensor, mesh: DeviceMesh) -> DTensor:
    with torch.no_grad():
        return DTensor.from_local(local, mesh, [Replicate()], run_check=False)
