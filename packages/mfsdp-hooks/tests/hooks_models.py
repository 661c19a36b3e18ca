"""The single-process reference trainer and helpers shared by the engine tests.

The toy model and data come from ``mfsdp_hooks.testing`` (re-exported here).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from mfsdp_hooks.testing import (
    HIDDEN,
    VOCAB,
    WIDTH,
    Block,
    ToyModel,
    assert_close_rel,
    local_slice,
    loss_fn,
    make_batches,
    make_model,
    train_data_parallel,
    train_single_process,
)
from mfsdp_hooks.testing.parity import full_state, shard_blocks, trainable

__all__ = [
    "HIDDEN",
    "VOCAB",
    "WIDTH",
    "Block",
    "ToyModel",
    "assert_close_rel",
    "full_state",
    "hfsdp_topology",
    "local_rows",
    "local_slice",
    "loss_fn",
    "make_batches",
    "make_model",
    "make_optimizer",
    "reference_training",
    "shard_blocks",
    "train_data_parallel",
    "trainable",
]


def make_optimizer(name: str, params: Any) -> torch.optim.Optimizer:
    if name == "adamw":
        return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)
    if name == "sgd":
        return torch.optim.SGD(params, lr=5e-2, momentum=0.9)
    raise ValueError(name)


def reference_training(
    optimizer_name: str, batches: list[Any], model_fn: Callable[[], nn.Module] = make_model
) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Single-process training on the global batch: the ground truth for parity tests."""
    model = model_fn()
    optimizer = make_optimizer(optimizer_name, trainable(model))
    losses = train_single_process(model, optimizer, batches)
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


def local_rows(param: Any) -> slice:
    """The rows of the full parameter that a distributed parameter holds on this rank."""
    from mfsdp_hooks import locate

    location = locate(param)
    assert location is not None, "not a distributed parameter"
    group = location.group
    piece = group.optim_layout.local_piece(location.index, group.topology.optim_rank)
    return slice(piece.row_start, piece.row_end)


def hfsdp_topology(outer: int, shard: int) -> Any:
    """HFSDP on an ``(outer, shard)`` CPU mesh: the optimizer state cut across ``dp_outer`` too
    (every rank of the default group holds a sub-shard)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from mfsdp_collectives import FSDPTopology

    mesh = init_device_mesh("cpu", (outer, shard), mesh_dim_names=("dp_outer", "dp_shard"))
    topology = FSDPTopology.from_mesh(mesh, dp_shard_dim="dp_shard", dp_outer_dim="dp_outer")
    topology.shard_optimizer_across_outer(dist.group.WORLD)  # type: ignore[arg-type]
    return topology


class OptionalBranch(nn.Module):
    """``fc``, and ``side`` only when the caller says so: a unit one of whose parameter sets
    goes unused on some steps or ranks (absent gradients, unused parameters)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.side = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor, use_side: bool) -> torch.Tensor:
        h = torch.tanh(self.fc(x))
        return h + self.side(h) if use_side else h


class AlignedBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(32, 64, bias=False)
        self.down = nn.Linear(64, 32, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(x)))


class AlignedModel(nn.Module):
    """Three MLP blocks and a head, dims in multiples of 16, so FSDP2's per-parameter padding
    and our layout agree: both engines then move the same bytes (side-by-side tests)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList(AlignedBlock() for _ in range(3))
        self.out = nn.Linear(32, 16, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.out(x)


def train_aligned(
    model: nn.Module, rank: int, steps: int, *, poison_rank: int | None = None
) -> list[float]:
    """AdamW steps of ``model`` (an ``AlignedModel``) on 2 ranks' shares of seeded batches;
    ``poison_rank``'s inputs are inf (every gradient it computes is then non-finite)."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for step in range(steps):
        generator = torch.Generator().manual_seed(step)
        x, y = torch.randn(8, 32, generator=generator), torch.randn(8, 16, generator=generator)
        rows = slice(4 * rank, 4 * rank + 4)
        inputs = x[rows] * float("inf") if rank == poison_rank else x[rows]
        loss = nn.functional.mse_loss(model(inputs), y[rows])
        loss.backward()  # type: ignore[no-untyped-call]
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


class ResidualBlock(nn.Module):
    """A residual MLP block (24 -> 40 -> 24): the unit of ``residual_model``."""

    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(24, 40)
        self.down = nn.Linear(40, 24)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(x)))


def residual_model() -> nn.Sequential:
    """Two residual blocks between an input and an output layer (seeded): what the describe
    tests shard block by block."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 24), ResidualBlock(), ResidualBlock(), nn.Linear(24, 5))
