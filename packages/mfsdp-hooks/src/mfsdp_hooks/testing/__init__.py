"""A toy model and data for tests of this layer and the layers above it.

Shapes are odd on purpose (7x15 and 15x7 weights cut unevenly over 2, 3 and 4 ranks, a 1-wide
output), the embedding is tied to the output head and one layer is frozen: the cases a
sharding engine gets wrong first. Test helpers of one package are not importable from another
package's tests, so they live here, next to ``mfsdp_collectives.testing``.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
import torch.utils.checkpoint
from torch import nn

VOCAB, WIDTH, HIDDEN = 11, 15, 7


class Block(nn.Module):
    def __init__(self, width: int = WIDTH, hidden: int = HIDDEN) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.fc1 = nn.Linear(width, hidden)
        self.fc2 = nn.Linear(hidden, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = x + self.fc2(torch.tanh(self.fc1(self.norm(x))))
        return out


class ToyModel(nn.Module):
    """Embedding tied to the output head, a frozen layer, blocks, and a 1-wide output.

    ``checkpoint``: ``None``, ``"reentrant"`` or ``"non_reentrant"`` activation recompute of
    every block.
    """

    def __init__(self, n_blocks: int = 3, checkpoint: str | None = None) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.frozen = nn.Linear(WIDTH, WIDTH)
        self.frozen.requires_grad_(False)
        self.blocks = nn.ModuleList(Block() for _ in range(n_blocks))
        self.head = nn.Linear(WIDTH, VOCAB, bias=False)
        self.head.weight = self.embed.weight
        self.value = nn.Linear(WIDTH, 1)
        self.checkpoint = checkpoint

    def forward(self, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = self.frozen(self.embed(tokens))
        for block in self.blocks:
            if self.checkpoint is None:
                x = block(x)
            else:
                reentrant = self.checkpoint == "reentrant"
                x = torch.utils.checkpoint.checkpoint(block, x, use_reentrant=reentrant)
        return self.head(x), self.value(x)


def make_model(seed: int = 0, **kwargs: Any) -> ToyModel:
    torch.manual_seed(seed)
    return ToyModel(**kwargs)


def loss_fn(outputs: tuple[torch.Tensor, torch.Tensor], targets: torch.Tensor) -> torch.Tensor:
    logits, value = outputs
    ce = F.cross_entropy(logits.float().reshape(-1, VOCAB), targets.reshape(-1))
    return ce + value.float().pow(2).mean()


def make_batches(
    steps: int, global_batch: int = 12, seq: int = 5, seed: int = 1
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(tokens, targets) per step; the default batch of 12 divides over 1, 2, 3 and 4 ranks."""
    generator = torch.Generator().manual_seed(seed)
    return [
        (
            torch.randint(0, VOCAB, (global_batch, seq), generator=generator),
            torch.randint(0, VOCAB, (global_batch, seq), generator=generator),
        )
        for _ in range(steps)
    ]


def train_single_process(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    batches: list[tuple[torch.Tensor, torch.Tensor]],
) -> list[float]:
    """Plain training on whole batches: the ground truth sharded runs are compared with."""
    return train_data_parallel(model, optimizer, batches, rank=0, world=1)


def train_data_parallel(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    batches: list[tuple[torch.Tensor, torch.Tensor]],
    rank: int,
    world: int,
    *,
    global_mean: bool = False,
) -> list[float]:
    """Each step on this rank's slice of the global batch. Returns each step's loss: this
    rank's, or with ``global_mean`` the mean over ranks (collective)."""
    losses = []
    for tokens, targets in batches:
        loss = loss_fn(model(local_slice(tokens, rank, world)), local_slice(targets, rank, world))
        loss.backward()  # type: ignore[no-untyped-call]
        optimizer.step()
        optimizer.zero_grad()
        total = loss.detach().clone()
        if global_mean and dist.is_initialized():
            dist.all_reduce(total)
            total /= world
        losses.append(total.item())
    return losses


def local_slice(batch: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    """This rank's equal share of a global batch (so the mean of local means is the global one)."""
    per_rank = batch.shape[0] // world
    return batch[rank * per_rank : (rank + 1) * per_rank]


def assert_close_rel(
    actual: torch.Tensor, expected: torch.Tensor, rtol: float, what: str, atol: float = 0.0
) -> None:
    """Max abs error (beyond ``atol``) relative to the largest expected magnitude."""
    assert actual.shape == expected.shape, f"{what}: shape {actual.shape} != {expected.shape}"
    if expected.numel() == 0:
        return
    scale = expected.abs().max().clamp_min(1e-6)
    err = ((actual - expected).abs().max() - atol).clamp_min(0) / scale
    assert err <= rtol, f"{what}: relative error {err:.3e} > {rtol:.1e} (atol {atol:.0e})"
