"""Single source of truth for the toy run behind the reference checkpoint fixture.

Plain torch only: no imports of ``megatron_fsdp`` or our ``mfsdp_*`` packages, so both
``tests/data/megatron_fsdp_0_6_1/make_fixture.py`` (run in a separate venv holding
NVIDIA's ``megatron-fsdp==0.6.1``) and our own tests can import it.

The toy run: ``make_model(seed=0)`` (fp32, CPU), optimizer ``make_optimizer(params, kind)``,
step ``s`` (1-based) trains on ``global_batch(s)`` (12 rows, split evenly over 1, 2, 3 or 4
ranks by ``local_batch``) with ``loss = F.mse_loss(model(x), y)`` (mean). The reference
checkpoint is written after ``SAVE_AT`` optimizer steps; a resumed run continues to ``TOTAL``.
``one_process_losses`` is the loss curve every sharded run must match.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

SAVE_AT = 4  # checkpoint after this many optimizer steps
TOTAL = 10  # total optimizer steps of a full (or resumed) run
GLOBAL_ROWS = 12  # splits evenly over 1, 2, 3 and 4 ranks
IN_FEATURES = 8
OUT_FEATURES = 5  # 5 output rows: uneven over 2 and 3 ranks
KINDS = ("sgd", "adamw")


class Block(nn.Module):
    """Residual MLP block: ``x + fc2(gelu(fc1(x)))``."""

    def __init__(self, width: int = 16, hidden: int = 24) -> None:
        super().__init__()
        self.fc1 = nn.Linear(width, hidden)
        self.fc2 = nn.Linear(hidden, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(F.gelu(self.fc1(x)))


class Toy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(IN_FEATURES, 16)
        self.blocks = nn.ModuleList([Block(), Block()])
        self.out = nn.Linear(16, OUT_FEATURES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for block in self.blocks:
            h = block(h)
        return self.out(h)


def make_model(seed: int = 0) -> Toy:
    """The toy model, deterministically initialised (fp32, CPU)."""
    torch.manual_seed(seed)
    return Toy().to(dtype=torch.float32, device="cpu")


def make_optimizer(params: Iterable[nn.Parameter], kind: str) -> torch.optim.Optimizer:
    if kind == "sgd":
        return torch.optim.SGD(params, lr=0.05, momentum=0.9)
    if kind == "adamw":
        return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.01)
    raise ValueError(f"unknown optimizer kind {kind!r}; expected one of {KINDS}")


def global_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch of (1-based) optimizer step ``step``: x (12, 8), y (12, 5)."""
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(GLOBAL_ROWS, IN_FEATURES, generator=g)
    y = torch.randn(GLOBAL_ROWS, OUT_FEATURES, generator=g)
    return x, y


def local_batch(step: int, rank: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s contiguous row chunk of ``global_batch(step)``."""
    if GLOBAL_ROWS % world:
        raise ValueError(f"{GLOBAL_ROWS} rows do not split evenly over {world} ranks")
    x, y = global_batch(step)
    rows = GLOBAL_ROWS // world
    sl = slice(rank * rows, (rank + 1) * rows)
    return x[sl].clone(), y[sl].clone()


def loss_fn(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(model(x), y)


def one_process_losses(kind: str, steps: int, seed: int = 0) -> list[float]:
    """Losses of steps 1..``steps`` of the plain one-process run on the global batch."""
    model = make_model(seed)
    opt = make_optimizer(model.parameters(), kind)
    losses = []
    for step in range(1, steps + 1):
        x, y = global_batch(step)
        loss = loss_fn(model, x, y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def train_steps(
    model: nn.Module, optimizer: torch.optim.Optimizer, steps: range, rank: int, world: int
) -> list[float]:
    """Data-parallel steps ``steps`` (1-based) on this rank's share of each global batch, the
    sharding library averaging gradients over the ranks. Returns each step's loss as the mean
    over ranks (a collective)."""
    losses = []
    for step in steps:
        loss = loss_fn(model, *local_batch(step, rank, world))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        losses.append((mean / world).item())
    return losses
