"""Parameters a rank's backward skips depending on its data (an expert that got no tokens,
a branch taken on one rank only): every rank must still issue the same collectives in the
same order, so training goes on, and equals data parallelism's definition (each rank's
gradient, with a skipped parameter's as zero, averaged over the ranks)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from hooks_models import OptionalBranch
from torch import nn

from mfsdp_collectives.testing import run_distributed
from mfsdp_hooks import fully_shard

STEPS = 10
ROWS = 4  # per rank


class Gated(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(6, 8)
        self.gates = nn.ModuleList([OptionalBranch() for _ in range(3)])
        self.out = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        use_side = bool(x[:, 0].sum() > 0)  # the data decides, per rank
        h = self.inp(x)
        for gate in self.gates:
            h = gate(h, use_side)
        return self.out(h)


def _batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank 0's inputs take the ``side`` branches, the other ranks' do not (odd steps), or
    the other way round (even steps)."""
    generator = torch.Generator().manual_seed(100 * step + rank)
    x = torch.randn(ROWS, 6, generator=generator)
    sign = 1.0 if (rank == 0) == (step % 2 == 1) else -1.0
    x[:, 0] = sign * x[:, 0].abs()
    return x, torch.randn(ROWS, 3, generator=generator)


def _model() -> Gated:
    torch.manual_seed(0)
    return Gated()


def _reference(world: int) -> list[float]:
    """One process: each rank's loss on its own batch (its own branch), averaged."""
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    losses = []
    for step in range(1, STEPS + 1):
        total = sum(F.mse_loss(model(x), y) for x, y in (_batch(step, r) for r in range(world)))
        mean = total / world
        mean.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(mean.item())
    return losses


def _sharded(rank: int, world: int, strategy: int) -> list[float]:
    model = _model()
    for gate in model.gates:
        fully_shard(gate, sharding_strategy=strategy)
    fully_shard(model, sharding_strategy=strategy)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    losses = []
    for step in range(1, STEPS + 1):
        x, y = _batch(step, rank)
        loss = F.mse_loss(model(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        losses.append(mean.item() / world)
    return losses


@pytest.mark.parametrize(("world", "strategy"), [(2, 3), (3, 2), (2, 0)])
def test_parameters_skipped_on_some_ranks_neither_hang_nor_skew(world: int, strategy: int) -> None:
    losses = run_distributed(_sharded, world, strategy, timeout=90)[0]
    expected = _reference(world)
    for step, (got, want) in enumerate(zip(losses, expected, strict=True), 1):
        assert abs(got - want) <= 1e-5 * abs(want), (step, losses, expected)
