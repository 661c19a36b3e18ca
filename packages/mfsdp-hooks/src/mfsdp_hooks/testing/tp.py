"""Tensor-parallel toy models for the FSDP x TP tests of this layer and the layers above:
``tp_model`` (torch's DTensor TP, or whole: the one-process reference) and
``megatron_tp_model`` (Megatron-Core-style TP layers: plain local tensors with its attributes).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

__all__ = [
    "TP_OUT",
    "TP_WIDTH",
    "MLPBlock",
    "TPModel",
    "full_value",
    "megatron_tp_model",
    "sequence_shard",
    "tp_model",
]

TP_WIDTH, TP_HIDDEN, TP_OUT = 8, 16, 4


class MLPBlock(nn.Module):
    def __init__(self, norm: bool) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(TP_WIDTH) if norm else nn.Identity()
        self.up = nn.Linear(TP_WIDTH, TP_HIDDEN)
        self.down = nn.Linear(TP_HIDDEN, TP_WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.down(torch.relu(self.up(self.norm(x))))
        return out if isinstance(self.norm, nn.LayerNorm) else x + out


class TPModel(nn.Module):
    def __init__(self, norm: bool = False) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([MLPBlock(norm), MLPBlock(norm)])
        self.head = nn.Linear(TP_WIDTH, TP_OUT)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        out: torch.Tensor = self.head(x)
        return out


def _plan(kind: str, last: bool) -> dict[str, ParallelStyle]:
    if kind == "mlp":
        return {"up": ColwiseParallel(), "down": RowwiseParallel()}
    # Sequence parallel: the norm runs on a sequence shard; the head sees the whole sequence.
    return {
        "norm": SequenceParallel(),
        "up": ColwiseParallel(input_layouts=Shard(1)),
        "down": RowwiseParallel(output_layouts=Replicate() if last else Shard(1)),
    }


def tp_model(kind: str, tp_mesh: DeviceMesh | None, *, meta: bool = False) -> TPModel:
    """``kind`` "mlp" or "sp", seeded identically on every rank; TP-parallel on ``tp_mesh``.
    ``meta``: built on the meta device (``fully_shard`` initialises it, seed 0 still set)."""
    torch.manual_seed(0)
    with torch.device("meta" if meta else "cpu"):
        model = TPModel(norm=kind == "sp")
    if tp_mesh is not None:
        blocks = list(model.blocks)
        for block in blocks:
            parallelize_module(block, tp_mesh, _plan(kind, block is blocks[-1]))
    return model


def sequence_shard(x: torch.Tensor, tp_mesh: DeviceMesh) -> torch.Tensor:
    """Sequence parallelism's input: this TP rank's shard of the sequence (dim 1)."""
    parts = x.chunk(tp_mesh.size(), dim=1)
    return DTensor.from_local(parts[tp_mesh.get_local_rank()], tp_mesh, [Shard(1)])


def full_value(value: torch.Tensor) -> torch.Tensor:
    """A DTensor's whole value (collective over its mesh); a plain tensor itself."""
    return value.full_tensor() if isinstance(value, DTensor) else value


class _CopyToTP(torch.autograd.Function):
    """Megatron's ``copy_to_tensor_model_parallel_region``: identity, all-reduce backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        grad = grad.clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _ReduceFromTP(torch.autograd.Function):
    """Megatron's ``reduce_from_tensor_model_parallel_region``: all-reduce, identity backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        out = x.clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


def _megatron_param(value: torch.Tensor, partition_dim: int | None) -> nn.Parameter:
    """A parameter with Megatron-Core's TP attributes (``partition_dim`` None: not TP)."""
    param = nn.Parameter(value.detach().clone())
    param.tensor_model_parallel = partition_dim is not None  # type: ignore[attr-defined]
    if partition_dim is not None:
        param.partition_dim = partition_dim  # type: ignore[attr-defined]
        param.partition_stride = 1  # type: ignore[attr-defined]
    return param


class ColumnParallelLinear(nn.Module):
    """This TP rank's rows of a ``Linear``: plain local tensors, Megatron-Core's attributes."""

    def __init__(self, full: nn.Linear, tp_mesh: DeviceMesh) -> None:
        super().__init__()
        size, rank = tp_mesh.size(), tp_mesh.get_local_rank()
        self.group = tp_mesh.get_group()
        self.weight = _megatron_param(full.weight.chunk(size, dim=0)[rank], 0)
        self.bias = _megatron_param(full.bias.chunk(size)[rank], 0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = _CopyToTP.apply(x, self.group)  # type: ignore[no-untyped-call]
        return nn.functional.linear(x, self.weight, self.bias)


class RowParallelLinear(nn.Module):
    """This TP rank's columns of a ``Linear``; the outputs are summed over TP, then biased."""

    def __init__(self, full: nn.Linear, tp_mesh: DeviceMesh) -> None:
        super().__init__()
        size, rank = tp_mesh.size(), tp_mesh.get_local_rank()
        self.group = tp_mesh.get_group()
        self.weight = _megatron_param(full.weight.chunk(size, dim=1)[rank], 1)
        self.bias = _megatron_param(full.bias, None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        partial = nn.functional.linear(x, self.weight)
        out: torch.Tensor = _ReduceFromTP.apply(partial, self.group)  # type: ignore[no-untyped-call]
        return out + self.bias


def megatron_tp_model(tp_mesh: DeviceMesh) -> TPModel:
    """The "mlp" ``TPModel`` with its blocks' linears replaced by Megatron-style TP layers
    holding this rank's slices of the same seeded weights."""
    model = tp_model("mlp", None)
    for block in model.blocks:
        assert isinstance(block, MLPBlock)
        up, down = block.up, block.down
        block.up = ColumnParallelLinear(up, tp_mesh)  # type: ignore[assignment]
        block.down = RowParallelLinear(down, tp_mesh)  # type: ignore[assignment]
    return model
