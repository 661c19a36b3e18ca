"""The GPT-like transformer both implementations train.

Defined here rather than imported from ``examples/`` so the benchmark model cannot drift with
the demo. Heads are untied (no weight shared between the embedding and the output layer),
so every block and the root own disjoint parameters under both FSDP implementations.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from benchmarks.configs import ModelConfig


class Attention(nn.Module):
    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, width = x.shape
        q, k, v = self.qkv(x).split(width, dim=-1)
        shape = (batch, seq, self.heads, width // self.heads)
        q, k, v = (t.view(shape).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        out: torch.Tensor = self.proj(y.transpose(1, 2).reshape(batch, seq, width))
        return out


class Block(nn.Module):
    """One FSDP unit: pre-norm attention and a 4x MLP."""

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(width)
        self.attn = Attention(width, heads)
        self.norm2 = nn.LayerNorm(width)
        self.fc1 = nn.Linear(width, 4 * width)
        self.fc2 = nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        out: torch.Tensor = x + self.fc2(F.gelu(self.fc1(self.norm2(x))))
        return out


class GPT(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        if cfg.width % cfg.heads:
            raise ValueError(f"width {cfg.width} must be a multiple of heads {cfg.heads}")
        self.tokens = nn.Embedding(cfg.vocab, cfg.width)
        self.positions = nn.Embedding(cfg.seq, cfg.width)
        self.blocks = nn.ModuleList(Block(cfg.width, cfg.heads) for _ in range(cfg.depth))
        self.norm = nn.LayerNorm(cfg.width)
        self.head = nn.Linear(cfg.width, cfg.vocab, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(idx.shape[1], device=idx.device)
        x = self.tokens(idx) + self.positions(positions)
        for block in self.blocks:
            x = block(x)
        out: torch.Tensor = self.head(self.norm(x))
        return out


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Cross-entropy in fp32 whatever the compute dtype, as mixed-precision training does."""
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1))


def make_batch(cfg: ModelConfig, rank: int, device: torch.device) -> tuple[torch.Tensor, ...]:
    """The per-rank batch: fixed per rank, identical across implementations and steps."""
    gen = torch.Generator().manual_seed(1000 + rank)
    data = torch.randint(0, cfg.vocab, (cfg.batch, cfg.seq + 1), generator=gen)
    return data[:, :-1].contiguous().to(device), data[:, 1:].contiguous().to(device)
