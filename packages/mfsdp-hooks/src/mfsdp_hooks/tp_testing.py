"""Tensor-parallel toy models for the FSDP x TP tests of this layer and the layers above.

``TPModel``: two residual MLP blocks (colwise ``up``, rowwise ``down``) and a plain head,
which TP leaves replicated. ``SPModel``: Megatron's layout, a sequence-parallel LayerNorm
before each colwise/rowwise pair. ``tp_model(kind, tp_mesh)`` builds either with a fixed seed
and parallelises it with torch's DTensor TP, or leaves it whole without a mesh (the
one-process reference, and plain FSDP).
"""

from __future__ import annotations

import torch
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

__all__ = ["TP_OUT", "TP_WIDTH", "TPModel", "full_value", "sequence_shard", "tp_model"]

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


def tp_model(kind: str, tp_mesh: DeviceMesh | None) -> TPModel:
    """``kind`` "mlp" or "sp", seeded identically on every rank; TP-parallel on ``tp_mesh``."""
    torch.manual_seed(0)
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
