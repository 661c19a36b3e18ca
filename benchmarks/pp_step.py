"""Pipeline parallelism x FSDP, ours against FSDP2 on the same schedule: 4 CPU ranks as
pp=2 x dp=2, the GPT stages of ``examples/train_gpt_pp.py``.

    torchrun --standalone --nproc-per-node 4 benchmarks/pp_step.py --impl ours
    torchrun --standalone --nproc-per-node 4 benchmarks/pp_step.py --impl fsdp2

Prints one line from rank 0: the median step time over the timed steps (after warm-up),
the reduce-scatters and all-gathers per step on that rank, with their bytes (ours:
``CommTracer``; FSDP2: ``C10dTracer``, which records torch's c10d ops the same way), and
the peak resident memory of each rank (``ru_maxrss``).
"""

from __future__ import annotations

import argparse
import resource
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.pipelining import Schedule1F1B, ScheduleGPipe

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))

# The example scripts are not a package: found through the path set above.
from train_gpt import make_corpus  # type: ignore[import-not-found]
from train_gpt_pp import DP, PP, cross_entropy, make_stage  # type: ignore[import-not-found]

from mfsdp_collectives import C10dTracer, CommLog, CommTracer, disable_host_transport

SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}


def _shard(module: nn.Module, impl: str, mesh: Any) -> Any:
    """Each block, then the stage root; returns the PipelineStage class to use."""
    if impl == "fsdp2":
        from torch.distributed.fsdp import fully_shard as torch_fully_shard
        from torch.distributed.pipelining import PipelineStage as TorchStage

        for block in module.blocks:  # type: ignore[union-attr]
            torch_fully_shard(block, mesh=mesh)
        torch_fully_shard(module, mesh=mesh)
        return TorchStage
    from megatron_fsdp.pipelining import PipelineStage
    from mfsdp_hooks import fully_shard

    for block in module.blocks:  # type: ignore[union-attr]
        fully_shard(block, mesh=mesh)
    fully_shard(module, mesh=mesh)
    return PipelineStage


def _counted(impl: str, step: Callable[[], None]) -> tuple[int, int, int, int]:
    """(reduce-scatters, their bytes, all-gathers, their bytes) ``step`` issues on this rank."""
    log: CommLog
    with C10dTracer() if impl == "fsdp2" else CommTracer() as log:
        step()
    return (
        log.calls("reduce_scatter"),
        log.bytes("reduce_scatter"),
        log.calls("all_gather"),
        log.bytes("all_gather"),
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--impl", choices=["ours", "fsdp2"], default="ours")
    parser.add_argument("--schedule", choices=sorted(SCHEDULES), default="1f1b")
    parser.add_argument("--steps", type=int, default=8, help="timed steps")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--depth", type=int, default=4)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--context", type=int, default=128)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--microbatches", type=int, default=4)
    args = parser.parse_args()

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (PP, DP), mesh_dim_names=("pp", "dp_shard"))
    stage_index = mesh["pp"].get_local_rank()
    torch.manual_seed(0)  # the same whole GPT on every rank, cut into stages
    text = make_corpus(2000)
    chars = sorted(set(text))
    data = torch.tensor([chars.index(c) for c in text], dtype=torch.long)
    module = make_stage(stage_index, len(chars), args.width, args.depth, args.heads, args.context)
    stage_class = _shard(module, args.impl, mesh["dp_shard"])
    stage = stage_class(module, stage_index, PP, torch.device("cpu"), group=mesh["pp"].get_group())
    schedule = SCHEDULES[args.schedule](
        stage, n_microbatches=args.microbatches, loss_fn=cross_entropy
    )
    optimizer = torch.optim.AdamW(module.parameters(), lr=1e-3)
    generator = torch.Generator().manual_seed(1234 + mesh["dp_shard"].get_local_rank())

    def one_step() -> None:
        starts = torch.randint(0, len(data) - args.context - 1, (args.batch,), generator=generator)
        x = torch.stack([data[s : s + args.context] for s in starts])
        y = torch.stack([data[s + 1 : s + args.context + 1] for s in starts])
        if stage_index == 0:
            schedule.step(x)
        else:
            schedule.step(target=y, losses=[])
        optimizer.step()
        optimizer.zero_grad()

    times, counts = [], (0, 0, 0, 0)
    for step in range(args.warmup + args.steps):
        dist.barrier()
        start = time.perf_counter()
        if step == args.warmup:
            counts = _counted(args.impl, one_step)
        else:
            one_step()
        dist.barrier()
        if step >= args.warmup:
            times.append((time.perf_counter() - start) * 1000)
    rss = torch.tensor([resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024])
    gathered = [torch.zeros_like(rss) for _ in range(PP * DP)]
    dist.all_gather(gathered, rss)
    if dist.get_rank() == 0:
        print(
            f"{args.impl} {args.schedule} pp={PP} x dp={DP} mb={args.microbatches}: "
            f"step {statistics.median(times):.0f} ms (min {min(times):.0f}, max {max(times):.0f}), "
            f"stage 0 rank 0 per step: {counts[0]} reduce-scatters ({counts[1]} B), "
            f"{counts[2]} all-gathers ({counts[3]} B), "
            f"RSS HWM MiB per rank {[round(g.item()) for g in gathered]}",
            flush=True,
        )
    disable_host_transport()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
