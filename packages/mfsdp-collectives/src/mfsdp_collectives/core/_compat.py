"""Version shims for the collectives this layer issues, and the one caller of each private
torch API. torch 2.13 deprecates ``all_gather_into_tensor``/``reduce_scatter_tensor`` (a
``FutureWarning`` per call) for ``all_gather_single``/``reduce_scatter_single``, which
2.11/2.12 lack."""

from __future__ import annotations

from typing import Any, Protocol, cast

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

__all__ = [
    "Work",
    "all_gather_single",
    "all_reduce_async",
    "backend_name",
    "dispatch_mode_active",
    "reduce_scatter_single",
    "supports_avg",
]


class Work(Protocol):
    """The part of ``torch.distributed``'s async work object that we rely on."""

    def wait(self) -> bool: ...

    def is_completed(self) -> bool: ...


_NEW_ALL_GATHER: Any = getattr(dist, "all_gather_single", None)
_NEW_REDUCE_SCATTER: Any = getattr(dist, "reduce_scatter_single", None)

# Backends whose collectives implement ReduceOp.AVG. Gloo gained it in torch 2.8
# (pytorch#149781) and this layer needs torch >= 2.11. Anything else (MPI, UCC,
# custom backends) takes the portable path: SUM, then divide the output shard.
# torch's fake group (a planning run) stands for gloo or nccl: it takes their route.
_AVG_BACKENDS = frozenset({"nccl", "gloo", "fake"})


def all_gather_single(
    output: torch.Tensor, input: torch.Tensor, group: dist.ProcessGroup, async_op: bool
) -> Work | None:
    """Gather ``input`` from every rank of ``group`` into ``output`` (concatenated)."""
    if _NEW_ALL_GATHER is not None:
        return cast("Work | None", _NEW_ALL_GATHER(output, input, group=group, async_op=async_op))
    return cast(  # pragma: no cover - torch < 2.13
        "Work | None",
        dist.all_gather_into_tensor(output, input, group=group, async_op=async_op),
    )


def reduce_scatter_single(
    output: torch.Tensor,
    input: torch.Tensor,
    op: dist.ReduceOp.RedOpType,
    group: dist.ProcessGroup,
    async_op: bool,
) -> Work | None:
    """Reduce ``input`` across ``group`` and leave this rank's chunk in ``output``."""
    if _NEW_REDUCE_SCATTER is not None:
        return cast(
            "Work | None",
            _NEW_REDUCE_SCATTER(output, input, op=op, group=group, async_op=async_op),
        )
    return cast(  # pragma: no cover - torch < 2.13
        "Work | None",
        dist.reduce_scatter_tensor(output, input, op=op, group=group, async_op=async_op),
    )


def all_reduce_async(
    tensor: torch.Tensor, op: dist.ReduceOp.RedOpType, group: dist.ProcessGroup
) -> Work | None:
    """Start an in-place all-reduce of ``tensor`` over ``group``."""
    return cast("Work | None", dist.all_reduce(tensor, op=op, group=group, async_op=True))


def dispatch_mode_active() -> bool:
    """Whether a ``TorchDispatchMode`` (``CommDebugMode``, ...) is active on this thread.
    torch 2.13 has no public query for it: this is the one place that calls the private one
    (a C call, cheap enough to make per collective)."""
    return bool(torch._C._len_torch_dispatch_stack() > 0)


def backend_name(group: dist.ProcessGroup) -> str:
    """Lower-case name of the backend behind ``group`` ("gloo", "nccl", ...)."""
    return str(dist.get_backend(group)).lower()


def supports_avg(group: dist.ProcessGroup) -> bool:
    """Whether ``ReduceOp.AVG`` can be used on ``group``: from the backend name alone, so
    every rank decides alike without a collective."""
    return backend_name(group) in _AVG_BACKENDS


def concatenate_meshes(meshes: list[DeviceMesh]) -> DeviceMesh:
    """One mesh whose dims are those of ``meshes`` (submeshes of one root mesh), as FSDP2
    builds its (dp, tp) mesh. torch has no public API for it yet (2.13): this is the one
    place that calls the private one."""
    try:
        joined: DeviceMesh = DeviceMesh._concatenate(meshes)
    except AttributeError as error:
        raise NotImplementedError(
            f"torch {torch.__version__} cannot join DeviceMeshes: FSDP x TP needs a torch "
            "whose DeviceMesh can be concatenated (2.10 or later)"
        ) from error
    except RuntimeError as error:
        raise ValueError(
            f"the DP mesh and the TP mesh {[m.mesh_dim_names for m in meshes]} must be "
            "submeshes of one DeviceMesh (e.g. mesh['dp_shard'] and mesh['tp'] of "
            f"init_device_mesh(..., mesh_dim_names=('dp_shard', 'tp'))): {error}"
        ) from error
    return joined


def flatten_mesh(mesh: DeviceMesh, name: str) -> DeviceMesh:
    """``mesh`` (a submesh of a root mesh) as one dim called ``name``, as torchtitan and
    Megatron-FSDP build their flattened data-parallel dims. Collective over the root mesh's
    ranks the first time a name is used; the same name again returns the same mesh. torch
    2.13 has no public API for it: this is the one place that calls the private one."""
    try:
        flat: DeviceMesh = mesh._flatten(name)
    except AttributeError as error:
        raise NotImplementedError(
            f"torch {torch.__version__} cannot flatten DeviceMesh dims: HFSDP x TP needs a "
            "torch whose DeviceMesh can be flattened (2.6 or later)"
        ) from error
    return flat
