"""Small models and a single-process reference trainer shared by the engine tests."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

VOCAB, WIDTH, HIDDEN = 11, 15, 7


class Block(nn.Module):
    """Odd shapes on purpose: 7x15 and 15x7 weights cut unevenly over 2, 3 and 4 ranks."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(WIDTH)
        self.fc1 = nn.Linear(WIDTH, HIDDEN)
        self.fc2 = nn.Linear(HIDDEN, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(torch.tanh(self.fc1(self.norm(x))))


class ToyModel(nn.Module):
    """Embedding tied to the output head, a frozen layer, blocks, and a 1-wide output."""

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
                x = torch.utils.checkpoint.checkpoint(
                    block, x, use_reentrant=self.checkpoint == "reentrant"
                )
        return self.head(x), self.value(x)


def make_model(seed: int = 0, **kwargs: Any) -> ToyModel:
    torch.manual_seed(seed)
    return ToyModel(**kwargs)


def loss_fn(outputs: tuple[torch.Tensor, torch.Tensor], targets: torch.Tensor) -> torch.Tensor:
    logits, value = outputs
    ce = F.cross_entropy(logits.float().reshape(-1, VOCAB), targets.reshape(-1))
    return ce + value.float().pow(2).mean()


def make_batches(steps: int, global_batch: int, seq: int = 5, seed: int = 1) -> list[Any]:
    generator = torch.Generator().manual_seed(seed)
    return [
        (
            torch.randint(0, VOCAB, (global_batch, seq), generator=generator),
            torch.randint(0, VOCAB, (global_batch, seq), generator=generator),
        )
        for _ in range(steps)
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
    optimizer = make_optimizer(optimizer_name, [p for p in model.parameters() if p.requires_grad])
    losses = []
    for tokens, targets in batches:
        loss = loss_fn(model(tokens), targets)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


def local_slice(batch: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    per_rank = batch.shape[0] // world
    return batch[rank * per_rank : (rank + 1) * per_rank]


def full_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter's full value, read from the unsharded buffers (test helper)."""
    from mfsdp_hooks import fsdp_units

    units = fsdp_units(model)
    for unit in units:
        unit.unshard()
    state = {k: v.detach().clone().float() for k, v in model.state_dict().items()}
    for unit in units:
        unit.reshard()
    return state


def assert_close_rel(
    actual: torch.Tensor, expected: torch.Tensor, rtol: float, what: str, atol: float = 0.0
) -> None:
    assert actual.shape == expected.shape, f"{what}: shape {actual.shape} != {expected.shape}"
    if expected.numel() == 0:
        return
    scale = expected.abs().max().clamp_min(1e-6)
    err = ((actual - expected).abs().max() - atol).clamp_min(0) / scale
    assert err <= rtol, f"{what}: relative error {err:.3e} > {rtol:.1e} (atol {atol:.0e})"


def local_rows(param: Any) -> slice:
    """The rows of the full parameter that a distributed parameter holds on this rank."""
    from mfsdp_hooks import locate

    location = locate(param)
    assert location is not None, "not a distributed parameter"
    group = location.group
    piece = group.layout.local_piece(location.index, group.topology.shard_rank)
    return slice(piece.row_start, piece.row_end)
