"""A small float8 model for the tests of this layer and above (torchao, CPU-capable).

Residual MLP blocks whose Linear layers torchao converts to ``Float8Linear`` with float8
all-gather weights, a LayerNorm (plain fp32 parameters in the same unit) and a head left in
high precision (mixed units). Every matmul dimension is a multiple of 16, as float8
``_scaled_mm`` needs.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

__all__ = ["F8_IN", "F8_OUT", "Float8Block", "float8_batch", "float8_model", "float8_step"]

F8_IN, F8_HIDDEN, F8_OUT = 32, 64, 16


class Float8Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(F8_IN)
        self.up = nn.Linear(F8_IN, F8_HIDDEN)
        self.down = nn.Linear(F8_HIDDEN, F8_IN)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = x + self.down(torch.relu(self.up(self.norm(x))))
        return out


class Float8Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([Float8Block(), Float8Block()])
        self.head = nn.Linear(F8_IN, F8_OUT)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        out: torch.Tensor = self.head(x)
        return out


def float8_model(*, float8_all_gather: bool = True, rowwise: bool = False) -> Float8Model:
    """The seeded model with its blocks' linears in torchao float8: tensorwise scaling with
    float8 all-gather weights by default; ``rowwise`` scaling (torchao has no float8
    all-gather for it: its weights stay plain parameters)."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    torch.manual_seed(0)
    model = Float8Model()
    if rowwise:
        config = Float8LinearConfig.from_recipe_name("rowwise")
    else:
        config = Float8LinearConfig(enable_fsdp_float8_all_gather=float8_all_gather)
    convert_to_float8_training(
        model, config=config, module_filter_fn=lambda _, fqn: fqn.startswith("blocks.")
    )
    return model


def float8_batch(step: int, rows: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(step)
    return torch.randn(rows, F8_IN, generator=gen), torch.randn(rows, F8_OUT, generator=gen)


def float8_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    step: int,
    parts: int,
    *,
    sharded: bool,
    reverse: bool = False,
) -> float:
    """One step on batch ``step`` cut into ``parts`` shares, returning the mean loss: this
    rank's share (``sharded``, the loss averaged over ranks), or in one process every share
    as a micro-batch of its own (in reverse order with ``reverse``: the gradients then sum in
    another order, which shows how far float rounding alone moves the reference). Float8
    scales activations per tensor, so this is how a one-process reference sees what data
    parallelism computes."""
    x, y = float8_batch(step)
    shares = [dist.get_rank()] if sharded else list(range(parts))[:: -1 if reverse else 1]
    loss = torch.zeros(())
    for share in shares:
        part = nn.functional.mse_loss(model(x.chunk(parts)[share]), y.chunk(parts)[share])
        part = part if sharded else part / parts
        part.backward()  # type: ignore[no-untyped-call]
        loss += part.detach()
    optimizer.step()
    optimizer.zero_grad()
    if sharded:
        dist.all_reduce(loss)
        loss /= parts
    return loss.item()
