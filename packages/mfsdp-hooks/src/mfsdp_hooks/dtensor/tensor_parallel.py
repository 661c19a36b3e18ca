"""Tensor-parallel parameters inside FSDP units: DTensors on a TP mesh, sharded again over DP
(the package README's "Tensor parallelism").

FSDP flattens each parameter's TP-local tensor and shards its rows over DP. Forward sees
DTensors on the TP mesh over views of the unsharded buffer (``unsharded_param``), so the TP
modules' own collectives run as before; a Megatron-Core TP parameter (a plain local tensor
marked ``tensor_model_parallel``, with ``partition_dim``) stays plain, as Megatron's layers
expect. A ``Partial`` gradient is reduced over TP to the parameter's placements first
(``grad_local``), so no DP collective ever spans the TP group. Everything here is local to
one rank: the spec is read from the parameter itself.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard

from mfsdp_collectives import FSDPTopology
from mfsdp_hooks.dtensor.dtensor_views import local_tensor, sharded_dtensor

__all__ = [
    "TPSpec",
    "carry_attributes",
    "check_tp_parameters",
    "grad_local",
    "tp_full_tensor",
    "tp_spec_of",
    "unsharded_param",
]


@dataclass(frozen=True)
class TPSpec:
    """How one parameter is cut across the TP ranks, read from its DTensor."""

    mesh: DeviceMesh
    placements: tuple[Placement, ...]
    global_shape: torch.Size
    local_offset: tuple[int, ...]
    """Where this rank's TP-local tensor starts in the global parameter, per dim."""
    computes_as_dtensor: bool = True
    """False for a Megatron-style parameter: its layers expect the plain local tensor."""
    partition_stride: int = 1
    """Megatron-Core's ``partition_stride`` (dim 0 only): the TP-local rows are this many
    equal blocks, block ``k`` of rank ``r`` at global row ``k * rows / stride + r * block``
    (a SwiGLU ``linear_fc1``: each rank holds ``[w_r; v_r]`` of the global ``[w; v]``).
    ``local_offset`` is where the rank's first block starts."""


def _local_offset(param: DTensor) -> tuple[int, ...]:
    """The global offset of this rank's local tensor (``torch.chunk`` semantics, which is
    how DTensor TP cuts parameters)."""
    offset = [0] * param.dim()
    coordinate = param.device_mesh.get_coordinate()
    assert coordinate is not None, "this rank is not on the parameter's TP mesh"
    for dim_index, placement in enumerate(param.placements):
        if isinstance(placement, Shard):
            size = param.shape[placement.dim]
            parts = param.device_mesh.size(dim_index)
            chunk = -(-size // parts)
            offset[placement.dim] += min(chunk * coordinate[dim_index], size)
    return tuple(offset)


def _megatron_spec(param: torch.Tensor, tp_mesh: DeviceMesh) -> TPSpec:
    """A Megatron-Core TP parameter: a plain local tensor cut evenly along ``partition_dim``
    (``tensor_model_parallel``, ``partition_dim``, ``partition_stride``, as its parallel
    layers set them)."""
    dim, stride = getattr(param, "partition_dim", None), getattr(param, "partition_stride", 1)
    strided_ok = stride == 1 or (dim == 0 and param.shape[0] % stride == 0)
    if not isinstance(dim, int) or not 0 <= dim < param.dim() or not strided_ok:
        raise NotImplementedError(
            f"a tensor_model_parallel parameter of shape {tuple(param.shape)} has "
            f"partition_dim={dim!r}, partition_stride={stride!r}: only contiguous partitions "
            "along one dim, or strided ones along dim 0 in equal blocks, can be sharded over DP"
        )
    size, rank = tp_mesh.size(), tp_mesh.get_local_rank()
    shape = list(param.shape)
    offset = [0] * len(shape)
    offset[dim], shape[dim] = rank * shape[dim] // stride, shape[dim] * size
    return TPSpec(tp_mesh, (Shard(dim),), torch.Size(shape), tuple(offset), False, stride)


def tp_spec_of(param: torch.Tensor, tp_mesh: DeviceMesh | None = None) -> TPSpec | None:
    """The TP spec of a DTensor parameter, or with ``tp_mesh`` (the topology's ``tp_dim``)
    of a Megatron-style one; None for a plain parameter."""
    if not isinstance(param, DTensor):
        if tp_mesh is not None and getattr(param, "tensor_model_parallel", False):
            return _megatron_spec(param, tp_mesh)
        return None
    return TPSpec(
        mesh=param.device_mesh,
        placements=tuple(param.placements),
        global_shape=param.shape,
        local_offset=_local_offset(param),
    )


def check_tp_parameters(
    named: Iterable[tuple[str, torch.Tensor]], topology: FSDPTopology, what: str
) -> None:
    """Refuse DTensor parameters the engine cannot shard, naming them (local, every rank):
    anything but Shard/Replicate on a 1-D mesh that joins ``topology``'s DP mesh."""
    named = list(named)
    bad = []
    for name, param in named:
        if not isinstance(param, DTensor):
            continue
        placements = param.placements
        if param.device_mesh.ndim != 1:
            bad.append(f"{name!r} is on a {param.device_mesh.ndim}-D mesh (only 1-D TP meshes)")
        elif not all(isinstance(p, (Shard, Replicate)) for p in placements):
            bad.append(f"{name!r} has placements {placements} (only Shard and Replicate)")
        elif not local_tensor(param).is_contiguous():
            bad.append(f"{name!r} has a non-contiguous local tensor")
    if bad:
        raise NotImplementedError(
            f"{what}: tensor-parallel parameter(s) {'; '.join(bad)} cannot be sharded over "
            "DP; parallelise with torch's ColwiseParallel/RowwiseParallel/SequenceParallel "
            "on a 1-D tp mesh"
        )
    meshes = {id(p.device_mesh): p.device_mesh for _, p in named if isinstance(p, DTensor)}
    for mesh in meshes.values():
        topology.with_tp(mesh)  # raises naming both meshes when they do not join


def local_value(param: torch.Tensor) -> torch.Tensor:
    """The tensor FSDP flattens: a DTensor's TP-local tensor, a plain tensor itself."""
    return local_tensor(param).detach()


def carry_attributes(source: nn.Parameter, target: nn.Parameter) -> None:
    """Give ``target`` the public attributes the model set on ``source`` (Megatron-Core's
    ``tensor_model_parallel``, ``partition_dim``, ``allreduce``, ``sequence_parallel``...):
    optimizers and gradient code choose parameter groups by them."""
    for name, value in vars(source).items():
        if not name.startswith("_"):
            setattr(target, name, value)


def unsharded_param(view: torch.Tensor, spec: TPSpec, requires_grad: bool) -> nn.Parameter:
    """The compute parameter forward and backward see: a DTensor on the TP mesh whose local
    tensor is ``view`` (a slice of the unsharded buffer)."""
    tensor = sharded_dtensor(view, spec.mesh, spec.global_shape, spec.placements)
    return nn.Parameter(tensor, requires_grad=requires_grad)


def grad_local(grad: torch.Tensor, spec: TPSpec | None) -> torch.Tensor:
    """The TP-local gradient DP reduces: a ``Partial`` gradient is first reduced over TP to
    the parameter's placements (a collective over TP, as TP training does anyway)."""
    if spec is None or not isinstance(grad, DTensor):
        return grad
    if tuple(grad.placements) != spec.placements:
        grad = grad.redistribute(spec.mesh, spec.placements)
    return local_tensor(grad)


def tp_full_tensor(local: torch.Tensor, spec: TPSpec) -> torch.Tensor:
    """The whole parameter from this rank's full TP-local tensor (collective over TP)."""
    with torch.no_grad():
        stacked = sharded_dtensor(local, spec.mesh, spec.global_shape, spec.placements)
        full = stacked.full_tensor()  # the ranks' local tensors one after the other
        stride = spec.partition_stride
        if stride == 1:
            return full
        # [rank][block] -> [block][rank]: block k of every rank, then block k + 1.
        ranks, rest = spec.mesh.size(), full.shape[1:]
        blocks = full.reshape(ranks, stride, -1, *rest).transpose(0, 1)
        return blocks.reshape(full.shape).contiguous()
