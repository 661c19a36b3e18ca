"""Wall time and peak live memory of wrapping a model built on meta versus built on the CPU.

``python -m benchmarks.meta_init`` runs 4 gloo ranks on a GPT of 12 blocks (width 512, about
38M parameters) and prints, per way of building: seconds to build and wrap, the peak of
live tensors while doing it (``LiveTensorTracker``), the whole model's bytes and the rank's
shards. Meta-device initialisation should peak near shards plus one unit; building on the
CPU first holds the whole model.
"""

from __future__ import annotations

import time

import torch

from benchmarks.configs import ModelConfig
from benchmarks.model import GPT, Block
from mfsdp_buffers import LiveTensorTracker
from mfsdp_collectives.testing import run_distributed
from mfsdp_hooks import FSDPRootWrapper, ShardingOptions, fsdp_units

CONFIG = ModelConfig("meta_init", width=512, depth=12, heads=8, seq=256, batch=1)
MiB = 2**20
WORLD = 4


def _wrap(rank: int, world: int, how: str) -> dict[str, float]:
    with LiveTensorTracker() as tracker:
        start = time.perf_counter()
        torch.manual_seed(0)
        if how == "meta":
            with torch.device("meta"):
                model = GPT(CONFIG)
            meta = ShardingOptions(init_model_with_meta_device=True)
            wrapped = FSDPRootWrapper(model, fsdp_unit_modules=[Block], options=meta)
        else:
            wrapped = FSDPRootWrapper(GPT(CONFIG), fsdp_unit_modules=[Block])
        seconds = time.perf_counter() - start
        peak = tracker.peak
    groups = [g for unit in fsdp_units(wrapped.module) for g in unit.groups]
    shards = sum((g.main or g.model).shard.numel() * 4 for g in groups)
    whole = sum(g.layout.data_numel * 4 for g in groups)
    return {"seconds": seconds, "peak": peak / MiB, "whole": whole / MiB, "shards": shards / MiB}


def main() -> None:
    print("| build | wrap wall s | peak live MiB | whole model MiB | this rank's shards MiB |")
    print("|---|---|---|---|---|")
    for how in ("meta", "cpu"):
        r = run_distributed(_wrap, WORLD, how, timeout=600)[0]
        print(
            f"| {how} | {r['seconds']:.2f} | {r['peak']:.1f} | {r['whole']:.1f} "
            f"| {r['shards']:.1f} |"
        )


if __name__ == "__main__":
    main()
