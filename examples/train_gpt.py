"""Train a small GPT with megatron-fsdp: the project's main job.

    torchrun --standalone --nproc-per-node 2 examples/train_gpt.py
    torchrun --standalone --nproc-per-node 2 examples/train_gpt.py --optimizer muon

Runs on CPU ranks with gloo by default (NCCL and CUDA when available). The corpus is built
in-process (no downloads): character-level text from a small generated grammar.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import resource
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.optim import Optimizer

from megatron_fsdp import (
    BlockQuantization,
    MixedPrecisionPolicy,
    Muon,
    fully_shard_model,
    fully_shard_optimizer,
    quantize_communication,
)
from mfsdp_collectives import disable_host_transport


class CausalSelfAttention(nn.Module):
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
        return self.proj(y.transpose(1, 2).reshape(batch, seq, width))


class TransformerBlock(nn.Module):
    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(width)
        self.attn = CausalSelfAttention(width, heads)
        self.norm2 = nn.LayerNorm(width)
        self.mlp = nn.Sequential(
            nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class GPT(nn.Module):
    def __init__(self, vocab: int, width: int, depth: int, heads: int, context: int) -> None:
        super().__init__()
        self.tokens = nn.Embedding(vocab, width)
        self.positions = nn.Embedding(context, width)
        self.blocks = nn.ModuleList(TransformerBlock(width, heads) for _ in range(depth))
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab, bias=False)
        self.head.weight = self.tokens.weight
        nn.init.normal_(self.tokens.weight, std=0.02)
        nn.init.normal_(self.positions.weight, std=0.02)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(idx.shape[1], device=idx.device)
        x = self.tokens(idx) + self.positions(positions)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


SUBJECTS = ["the cat", "a dog", "the old sailor", "my sister", "the small robot", "a farmer"]
VERBS = ["sees", "finds", "paints", "carries", "follows", "builds"]
OBJECTS = ["a red boat", "the bright moon", "an apple", "the long road", "a wooden box"]
PLACES = ["by the river", "in the garden", "at dawn", "near the hill", "under the bridge"]


def make_corpus(sentences: int, seed: int = 0) -> str:
    """Deterministic text with learnable structure, identical on every rank."""
    rng = random.Random(seed)
    lines = [
        f"{rng.choice(SUBJECTS)} {rng.choice(VERBS)} {rng.choice(OBJECTS)} {rng.choice(PLACES)}."
        for _ in range(sentences)
    ]
    return "\n".join(lines) + "\n"


def memory_mib(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def learning_rate_factor(step: int, warmup: int, total: int) -> float:
    """GPT's schedule: linear warm-up, then a cosine from 1 down to 0.1 at ``total``."""
    if step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return 0.1 + 0.45 * (1 + math.cos(math.pi * progress))


def write_losses(path: str, every_step: list[torch.Tensor], held_out: float, world: int) -> None:
    """Rank 0 writes each step's loss averaged over the ranks (one all-reduce at the end)."""
    losses = torch.cat(every_step)
    dist.all_reduce(losses)
    if dist.get_rank() == 0:
        record = {"losses": (losses / world).tolist(), "held_out": held_out}
        with open(path, "w") as file:
            json.dump(record, file)


def build_optimizer(model: nn.Module, kind: str, lr: float, muon_lr: float) -> Optimizer:
    """AdamW over everything, or Muon as its users configure it: the blocks' weight matrices
    in Muon, embeddings, norms, biases and the head in a ``use_muon=False`` (AdamW) group."""
    if kind == "adamw":
        return torch.optim.AdamW(model.parameters(), lr=lr)
    named = list(model.named_parameters())
    hidden = [p for n, p in named if "blocks." in n and p.ndim == 2]
    rest = [p for n, p in named if not ("blocks." in n and p.ndim == 2)]
    groups = [{"params": hidden}, {"params": rest, "use_muon": False, "lr": lr}]
    return Muon(groups, lr=muon_lr)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument("--depth", type=int, default=4)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--context", type=int, default=64)
    parser.add_argument("--batch", type=int, default=16, help="sequences per rank per step")
    parser.add_argument("--lr", type=float, default=3e-3, help="peak learning rate")
    parser.add_argument(
        "--warmup-steps",
        type=int,
        default=15,
        help="linear warm-up to --lr, then a cosine decay to a tenth of it at the last step",
    )
    parser.add_argument(
        "--optimizer",
        choices=("adamw", "muon"),
        default="adamw",
        help="muon: megatron_fsdp.Muon on the blocks' matrices (exact on shards), AdamW elsewhere",
    )
    parser.add_argument("--muon-lr", type=float, default=2e-2, help="peak learning rate of Muon")
    parser.add_argument("--zero-dp-strategy", default="optim_grads_params")
    parser.add_argument("--bf16", action="store_true", help="bf16 compute, fp32 main weights")
    parser.add_argument(
        "--quantize-comms",
        choices=("none", "grads", "grads+weights"),
        default="none",
        help="int8 block-quantized gradient reduce-scatters (and weight all-gathers)",
    )
    parser.add_argument(
        "--quantize-bits", type=int, choices=(8, 4), default=8, help="bits per quantized value"
    )
    parser.add_argument("--log-every", type=int, default=10, help="steps between loss reports")
    parser.add_argument(
        "--losses", default=None, help="write every step's loss (mean over ranks) to this JSON file"
    )
    args = parser.parse_args()

    use_cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if use_cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = (
        torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        if use_cuda
        else torch.device("cpu")
    )
    if use_cuda:
        torch.cuda.set_device(device)
    torch.manual_seed(0)

    text = make_corpus(4000)
    chars = sorted(set(text))
    data = torch.tensor([chars.index(c) for c in text], dtype=torch.long)
    # held out: other sentences of the same grammar, the same 16 windows every evaluation
    held_text = make_corpus(200, seed=1)
    held = torch.tensor([chars.index(c) for c in held_text], dtype=torch.long)
    held_starts = torch.linspace(0, len(held) - args.context - 2, 16).long()[rank::world]
    model = GPT(len(chars), args.width, args.depth, args.heads, args.context).to(device)
    n_params = sum(p.numel() for p in model.parameters())
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16) if args.bf16 else None
    model = fully_shard_model(
        model,
        fsdp_unit_modules=[TransformerBlock],
        zero_dp_strategy=args.zero_dp_strategy,
        mixed_precision_policy=policy,
    )
    optimizer = fully_shard_optimizer(build_optimizer(model, args.optimizer, args.lr, args.muon_lr))
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: learning_rate_factor(step, args.warmup_steps, args.steps)
    )
    if args.quantize_comms != "none":
        spec = BlockQuantization(bits=args.quantize_bits)
        weights = spec if args.quantize_comms == "grads+weights" else None
        quantize_communication(model, gradients=spec, weights=weights)

    generator = torch.Generator().manual_seed(1234 + rank)
    if rank == 0:
        print(
            f"GPT {n_params / 1e6:.2f}M params, {world} ranks ({'nccl' if use_cuda else 'gloo'}),"
            f" strategy {args.zero_dp_strategy}, {len(text)} characters of text",
            flush=True,
        )

    def held_out_loss() -> float:
        """Mean loss on the held-out windows (every rank takes its share of them)."""
        x = torch.stack([held[s : s + args.context] for s in held_starts]).to(device)
        y = torch.stack([held[s + 1 : s + args.context + 1] for s in held_starts]).to(device)
        model.eval()
        with torch.no_grad():
            logits = model(x)
            mean = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), y.reshape(-1))
        model.train()
        total = mean.detach().reshape(1) * len(held_starts)
        dist.all_reduce(total)
        return float(total) / 16

    first_loss = last_loss = math.nan
    every_step: list[torch.Tensor] = []
    start = time.perf_counter()
    tokens_seen = 0
    for step in range(1, args.steps + 1):
        starts = torch.randint(0, len(data) - args.context - 1, (args.batch,), generator=generator)
        x = torch.stack([data[s : s + args.context] for s in starts]).to(device)
        y = torch.stack([data[s + 1 : s + args.context + 1] for s in starts]).to(device)
        logits = model(x)
        loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), y.reshape(-1))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        schedule.step()
        if args.losses is not None:
            every_step.append(loss.detach().reshape(1))
        tokens_seen += x.numel() * world
        if step % args.log_every == 0 or step == 1 or step == args.steps:
            stats = torch.tensor([loss.item(), memory_mib(device)], device=device)
            gathered = [torch.zeros_like(stats) for _ in range(world)]
            dist.all_gather(gathered, stats)
            mean_loss = sum(g[0].item() for g in gathered) / world
            first_loss = mean_loss if step == 1 else first_loss
            last_loss = mean_loss
            if rank == 0:
                elapsed = time.perf_counter() - start
                done = int(30 * step / args.steps)
                memory = " ".join(f"r{i}:{g[1].item():.0f}MiB" for i, g in enumerate(gathered))
                sys.stdout.write(
                    f"\r[{'#' * done}{'.' * (30 - done)}] step {step}/{args.steps} "
                    f"loss {mean_loss:.3f} {tokens_seen / elapsed:,.0f} tok/s mem {memory}"
                )
                sys.stdout.flush()
    held_out = held_out_loss()
    if args.losses is not None:
        write_losses(args.losses, every_step, held_out, world)
    if rank == 0:
        print(f"\nloss {first_loss:.3f} -> {last_loss:.3f} (held out {held_out:.3f})", flush=True)
    disable_host_transport()
    dist.destroy_process_group()
    if not last_loss < first_loss:
        raise SystemExit("loss did not fall")


if __name__ == "__main__":
    main()
