"""Gradient clipping for Megatron-Core model chunks wrapped by ``megatron_fsdp.mcore``.

One norm over the whole model, whatever the layout: each element of each gradient is
counted once, on one rank, and one all-reduce over the world adds the ranks' parts.

Which rank counts an element: a gradient is a DTensor on its unit's mesh, its ``Shard`` dims
disjoint, its ``Replicate`` dims copies (counted at coordinate 0). A copy the DTensor does not
describe lives on a dim of the chunk's mesh it lacks (a parameter that is not tensor-parallel
on every TP rank, sequence-parallel norms once ``finalize_model_grads`` summed them, HSDP's
instances): it counts at coordinate 0 of that dim. Pipeline stages and expert-parallel ranks
each count their own. torch's ``clip_grad_norm_`` cannot do this: it sees one DTensor mesh per
call and no pipeline.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from mfsdp_hooks import optimizer_grad

__all__ = ["clip_grad_norm"]


def _counted_here(grad: torch.Tensor, chunk_mesh: DeviceMesh) -> bool:
    """Whether this rank's part of ``grad`` is the one copy counted (see the module doc)."""
    covered: set[str] = set()
    if isinstance(grad, DTensor):
        mesh = grad.device_mesh
        names = mesh.mesh_dim_names or ()
        for dim, placement in enumerate(grad.placements):
            if not placement.is_shard() and mesh.get_local_rank(dim) != 0:
                return False
        covered = set(names)
    return all(
        chunk_mesh.get_local_rank(name) == 0
        for name in chunk_mesh.mesh_dim_names or ()
        if name not in covered
    )


def _local(grad: torch.Tensor) -> torch.Tensor:
    return grad.to_local() if isinstance(grad, DTensor) else grad


def clip_grad_norm(
    model_chunks: Any | Sequence[Any], max_norm: float, norm_type: float = 2.0
) -> torch.Tensor:
    """Scale every gradient of ``model_chunks`` (this rank's chunks, as the adapter returned
    them) so that the whole model's gradient norm is at most ``max_norm``; returns that norm
    (before clipping), the same on every rank. Call it on every rank after
    ``finalize_model_grads`` (or ``finish_grad_sync``) and before the optimizer step."""
    chunks: list[Any] = (
        list(model_chunks) if isinstance(model_chunks, (list, tuple)) else [model_chunks]
    )
    if not max_norm > 0:
        raise ValueError(f"max_norm must be positive, got {max_norm!r}")
    if not (norm_type == math.inf or norm_type > 0):
        raise ValueError(f"norm_type must be positive or math.inf, got {norm_type!r}")
    counted: list[torch.Tensor] = []
    grads: list[torch.Tensor] = []
    for chunk in chunks:
        index = getattr(chunk, "megatron_fsdp_dist_index", None)
        if index is None:
            raise TypeError(
                f"model_chunks: {type(chunk).__name__} is not a chunk wrapped by "
                "megatron_fsdp.mcore.FullyShardedDataParallel"
            )
        for grad in _grads(chunk.parameters()):
            grads.append(grad)
            if _counted_here(grad, index.device_mesh):
                counted.append(_local(grad).detach().double())
    total = _global_norm(counted, norm_type)
    coefficient = max_norm / (total.item() + 1e-6)
    if coefficient < 1.0:
        for grad in grads:
            grad.mul_(coefficient)
    return total.float()


def _grads(params: Iterable[torch.nn.Parameter]) -> Iterable[torch.Tensor]:
    grads = (optimizer_grad(p) for p in params)  # ``.grad`` or ``decoupled_grad``
    return (g for g in grads if g is not None)


def _global_norm(parts: list[torch.Tensor], norm_type: float) -> torch.Tensor:
    """The norm over every rank's counted parts (one all-reduce over the world)."""
    if norm_type == math.inf:
        total = torch.zeros((), dtype=torch.float64)
        for part in parts:
            if part.numel():
                total = torch.maximum(total, part.abs().max())
        dist.all_reduce(total, op=dist.ReduceOp.MAX)
        return total
    total = torch.zeros((), dtype=torch.float64)
    for part in parts:
        total += torch.linalg.vector_norm(part, norm_type) ** norm_type
    dist.all_reduce(total)
    return total ** (1.0 / norm_type)
