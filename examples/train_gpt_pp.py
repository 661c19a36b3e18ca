"""Train a small GPT with pipeline parallelism x FSDP: 4 CPU ranks as pp=2 x dp=2.

    torchrun --standalone --nproc-per-node 4 examples/train_gpt_pp.py

Each pipeline stage is half of the model, sharded over its data-parallel pair with the
per-module ``fully_shard`` (each block, then the stage root); torch's own schedules
(``--schedule gpipe`` or ``1f1b``) drive the micro-batches through
``megatron_fsdp.pipelining.PipelineStage``, which makes each unit reduce its gradients once
per step. The corpus is the main job's (``train_gpt.py``), built in-process.
"""

from __future__ import annotations

import argparse
import math
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.pipelining import Schedule1F1B, ScheduleGPipe
from train_gpt import GPT, make_corpus

from megatron_fsdp.pipelining import PipelineStage
from mfsdp_collectives import disable_host_transport
from mfsdp_hooks import fully_shard

PP, DP = 2, 2
SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}


class FirstStage(nn.Module):
    """The GPT's token and position embeddings and the first ``half`` of its blocks (the
    GPT's own modules)."""

    def __init__(self, gpt: GPT, half: int) -> None:
        super().__init__()
        self.tokens, self.positions = gpt.tokens, gpt.positions
        self.blocks = nn.ModuleList(gpt.blocks[:half])

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(idx.shape[1], device=idx.device)
        x = self.tokens(idx) + self.positions(positions)
        for block in self.blocks:
            x = block(x)
        return x


class LastStage(nn.Module):
    """The GPT's other blocks, its final norm and its output head, untied: the embedding it
    shares the head's weight with lives on the other stage, so the head starts as a copy."""

    def __init__(self, gpt: GPT, half: int) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(gpt.blocks[half:])
        self.norm = gpt.norm
        self.head = gpt.head
        self.head.weight = nn.Parameter(gpt.head.weight.detach().clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def make_stage(
    stage_index: int, vocab: int, width: int, depth: int, heads: int, context: int
) -> nn.Module:
    """This rank's half of a ``depth``-block GPT (unsharded): every rank builds the same
    whole GPT (seed it alike) and keeps its stage's modules."""
    gpt = GPT(vocab, width, depth, heads, context)
    half = depth // 2
    return FirstStage(gpt, half) if stage_index == 0 else LastStage(gpt, half)


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--width", type=int, default=96)
    parser.add_argument("--depth", type=int, default=4, help="blocks in all, split in two")
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--context", type=int, default=64)
    parser.add_argument("--batch", type=int, default=16, help="sequences per DP rank per step")
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--schedule", choices=sorted(SCHEDULES), default="1f1b")
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--zero-dp-strategy", type=int, default=3, choices=[1, 2, 3])
    args = parser.parse_args()

    dist.init_process_group("gloo")
    if dist.get_world_size() != PP * DP:
        raise SystemExit(f"run on {PP * DP} ranks (pp={PP} x dp={DP}): --nproc-per-node 4")
    mesh = init_device_mesh("cpu", (PP, DP), mesh_dim_names=("pp", "dp_shard"))
    stage_index, dp_rank = mesh["pp"].get_local_rank(), mesh["dp_shard"].get_local_rank()
    torch.manual_seed(0)  # the same whole GPT on every rank: each stage keeps its half

    text = make_corpus(4000)
    chars = sorted(set(text))
    data = torch.tensor([chars.index(c) for c in text], dtype=torch.long)
    module = make_stage(stage_index, len(chars), args.width, args.depth, args.heads, args.context)
    for block in module.blocks:  # type: ignore[union-attr]
        fully_shard(block, mesh=mesh["dp_shard"], sharding_strategy=args.zero_dp_strategy)
    fully_shard(module, mesh=mesh["dp_shard"], sharding_strategy=args.zero_dp_strategy)
    stage = PipelineStage(
        module, stage_index, PP, torch.device("cpu"), group=mesh["pp"].get_group()
    )
    schedule = SCHEDULES[args.schedule](
        stage, n_microbatches=args.microbatches, loss_fn=cross_entropy
    )
    optimizer = torch.optim.AdamW(module.parameters(), lr=args.lr)

    generator = torch.Generator().manual_seed(1234 + dp_rank)  # same batches along a pipeline
    first = last = math.nan
    for step in range(1, args.steps + 1):
        starts = torch.randint(0, len(data) - args.context - 1, (args.batch,), generator=generator)
        x = torch.stack([data[s : s + args.context] for s in starts])
        y = torch.stack([data[s + 1 : s + args.context + 1] for s in starts])
        losses: list[torch.Tensor] = []
        if stage_index == 0:
            schedule.step(x)
        else:
            schedule.step(target=y, losses=losses)
        optimizer.step()
        optimizer.zero_grad()
        mean = torch.tensor([sum(loss.item() for loss in losses) / len(losses) if losses else 0.0])
        dist.all_reduce(mean)  # only the last stage's DP pair adds a loss
        mean /= DP
        first = mean.item() if step == 1 else first
        last = mean.item()
        if dist.get_rank() == 0 and (step % 10 == 0 or step == 1):
            sys.stdout.write(f"\rstep {step}/{args.steps} loss {last:.3f}")
            sys.stdout.flush()
    if dist.get_rank() == 0:
        print(
            f"\npp={PP} x dp={DP}, {args.schedule}, {args.microbatches} micro-batches, "
            f"ZeRO-{args.zero_dp_strategy}: loss {first:.3f} -> {last:.3f}",
            flush=True,
        )
    disable_host_transport()
    dist.destroy_process_group()
    if not last < first:
        raise SystemExit("loss did not fall")


if __name__ == "__main__":
    main()
