"""``plan_memory`` against a real run of the same Llama, side by side (issue 52).

For each model (``LlamaConfig``: ``953m``, 16 layers of hidden 2048, 4x2048 tokens;
``29m``, 32 layers of hidden 256; ``tiny`` for a smoke run) the plan is made from the model
on the meta device, then the same model trains for three AdamW steps on one rank
(``fully_shard_model``, bf16 compute, fp32 main weights and reduction): on CUDA the peak of
the last step is ``torch.cuda.max_memory_allocated`` and the bytes between steps
``torch.cuda.memory_allocated`` after ``optimizer.step()``; on a CPU our live-tensor
tracker's. ``python -m benchmarks.plan_vs_measured --device cuda --models 953m 29m`` prints
the table ``scripts/gpu_check.py`` records.

``--bench`` instead plans the benchmarks' default model (``benchmarks/configs.py``, 9.9M
parameters, 1024 tokens per rank) on 2 and 4 CPU ranks under each option issue 52 lists
(ZeRO-0..3, fp32 and bf16, HSDP 2x2, int reshard, int8 gradients, activation checkpointing)
and trains it on real gloo ranks: the largest rank's peak and bytes between steps by our
tracker and torch's ``MemTracker``.
"""

from __future__ import annotations

import argparse
import functools
import json
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

from benchmarks.llama import llama, markdown_table
from mfsdp_collectives.testing import run_distributed

ROOT = Path(__file__).resolve().parents[1]
# name: (hidden, intermediate, layers, heads, vocab, batch, seq)
MODELS = {
    "953m": (2048, 5632, 16, 16, 32000, 4, 2048),
    "29m": (256, 512, 32, 4, 16000, 4, 2048),
    "tiny": (64, 128, 4, 4, 256, 2, 32),
}


def _llama(name: str) -> nn.Module:
    hidden, inter, layers, heads, vocab, _, _ = MODELS[name]
    return llama(hidden, inter, layers, heads, vocab, max_positions=4096)


def _arguments() -> dict[str, Any]:
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    from megatron_fsdp import MixedPrecisionPolicy

    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    return {"fsdp_unit_modules": [LlamaDecoderLayer], "mixed_precision_policy": policy}


def _tokens(name: str, device: str) -> torch.Tensor:
    _, _, _, _, vocab, batch, seq = MODELS[name]
    generator = torch.Generator().manual_seed(0)
    return torch.randint(0, vocab, (batch, seq), generator=generator).to(device)


def _loss(output: Any) -> torch.Tensor:
    loss: torch.Tensor = output.logits.float().logsumexp(-1).mean()
    return loss


def _measured(rank: int, world: int, name: str, device: str) -> dict[str, int]:
    """Three steps of the real model on this rank: the last step's peak, the bytes between."""
    from megatron_fsdp import fully_shard_model, fully_shard_optimizer
    from mfsdp_buffers import LiveTensorTracker

    cuda = device == "cuda"
    tracker = LiveTensorTracker()
    tokens = _tokens(name, device)
    with tracker:
        with torch.device(device):
            model = _llama(name)
        sharded = fully_shard_model(model, **_arguments())
        optimizer = fully_shard_optimizer(torch.optim.AdamW(sharded.parameters(), lr=1e-4))
        for _ in range(3):
            if cuda:
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
            tracker.reset_phase()
            torch.autograd.backward(_loss(sharded(tokens)))
            optimizer.step()
            if cuda:
                torch.cuda.synchronize()
            between = torch.cuda.memory_allocated() if cuda else tracker.live
            optimizer.zero_grad()
    peak = torch.cuda.max_memory_allocated() if cuda else tracker.phase_peak
    return {"peak": int(peak), "between": int(between)}


def _planned(name: str, device: str) -> dict[str, Any]:
    from megatron_fsdp import plan_memory

    with torch.device("meta"):
        model = _llama(name)
    started = time.perf_counter()
    plan = plan_memory(
        model,
        world_size=1,
        example_inputs=(_tokens(name, "cpu").to("meta"),),
        loss_fn=_loss,
        device=device,
        **_arguments(),
    )
    return {
        "peak": plan.peak_bytes,
        "between": plan.between_steps_bytes,
        "phase": plan.peak_phase,
        "seconds": time.perf_counter() - started,
    }


def compare(models: list[str], device: str) -> list[dict[str, Any]]:
    rows = []
    backend = "nccl" if device == "cuda" else "gloo"
    for name in models:
        planned = _planned(name, device)
        (measured,) = run_distributed(_measured, 1, name, device, timeout=600, backend=backend)
        rows.append({"model": name, "device": device, "planned": planned, "measured": measured})
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    columns = ["model", "device", "planned peak", "measured peak", "error", "vs MemTracker"]
    columns += ["planned between", "measured between", "error", "planned in"]
    cells = []
    for row in rows:
        p, m = row["planned"], row["measured"]
        mib = 2**20
        independent = f"{p['peak'] / m['memtracker'] - 1:+.1%}" if "memtracker" in m else "-"
        peak, between = (
            [f"{p[k] / mib:,.0f} MiB", f"{m[k] / mib:,.0f} MiB", f"{p[k] / m[k] - 1:+.1%}"]
            for k in ("peak", "between")
        )
        seconds = f"{p['seconds']:.1f} s"
        cells.append([row["model"], row["device"], *peak, independent, *between, seconds])
    return markdown_table(columns, cells)


# name: (world, fully_shard_model arguments, bf16, outer_dp_size, int8 gradients, checkpointed)
BENCH_CASES: dict[str, tuple[int, dict[str, Any], bool, int, bool, bool]] = {
    "zero0": (2, {"zero_dp_strategy": 0}, False, 1, False, False),
    "zero1": (2, {"zero_dp_strategy": 1}, False, 1, False, False),
    "zero2-bf16": (2, {"zero_dp_strategy": 2}, True, 1, False, False),
    "zero3": (2, {}, False, 1, False, False),
    "zero3-bf16": (4, {}, True, 1, False, False),
    "zero1-bf16": (4, {"zero_dp_strategy": 1}, True, 1, False, False),
    "zero3-pairs": (4, {"reshard_after_forward_group_size": 2}, False, 1, False, False),
    "zero3-int8": (4, {}, False, 1, True, False),
    "zero3-checkpointed": (4, {}, False, 1, False, True),
    "hsdp-2x2": (4, {}, False, 2, False, False),
}


def _bench_model(checkpointed: bool) -> nn.Module:
    from torch.utils.checkpoint import checkpoint

    from benchmarks.configs import CONFIGS
    from benchmarks.model import GPT

    class Checkpointed(GPT):
        def forward(self, idx: torch.Tensor) -> torch.Tensor:
            positions = torch.arange(idx.shape[1], device=idx.device)
            x = self.tokens(idx) + self.positions(positions)
            for block in self.blocks:
                x = checkpoint(block, x, use_reentrant=False)
            out: torch.Tensor = self.head(self.norm(x))
            return out

    return (Checkpointed if checkpointed else GPT)(CONFIGS["default"])


def _bench_arguments(name: str) -> tuple[dict[str, Any], Any]:
    from benchmarks.model import Block
    from megatron_fsdp import MixedPrecisionPolicy, quantize_communication

    _, extra, bf16, _, int8, _ = BENCH_CASES[name]
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16) if bf16 else None
    arguments = {"fsdp_unit_modules": [Block], "mixed_precision_policy": policy, **extra}
    # On the training thread: a dispatch-mode tracker cannot see a worker thread's buffers.
    after = (lambda model: quantize_communication(model, background=False)) if int8 else None
    return arguments, after


def _bench_measured(rank: int, world: int, name: str) -> dict[str, int]:
    import torch.distributed as dist
    from torch.distributed._tools.mem_tracker import MemTracker
    from torch.distributed.device_mesh import init_device_mesh

    from benchmarks.configs import CONFIGS
    from benchmarks.model import loss_fn, make_batch
    from megatron_fsdp import fully_shard_model, fully_shard_optimizer
    from mfsdp_buffers import LiveTensorTracker

    torch.set_num_threads(1)
    outer, checkpointed = BENCH_CASES[name][3], BENCH_CASES[name][5]
    arguments, after = _bench_arguments(name)
    if outer > 1:
        names = ("dp_outer", "dp_shard")
        mesh = init_device_mesh("cpu", (outer, world // outer), mesh_dim_names=names)
        arguments.update(device_mesh=mesh, dp_outer_dim=names[0], dp_shard_dim=names[1])
        arguments["hybrid_fsdp_group"] = dist.group.WORLD
    tokens, targets = make_batch(CONFIGS["default"], 0, torch.device("cpu"))
    with LiveTensorTracker() as tracker:
        torch.manual_seed(0)
        model = fully_shard_model(_bench_model(checkpointed), **arguments)
        if after is not None:
            after(model)
        optimizer = fully_shard_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-4))
        for _ in range(3):
            tracker.reset_phase()
            torch.autograd.backward(loss_fn(model(tokens), targets))
            optimizer.step()
            between = tracker.live
            optimizer.zero_grad()
    peak = tracker.phase_peak
    independent = MemTracker()
    independent.track_external(model, optimizer)
    with independent:
        for _ in range(2):
            torch.autograd.backward(loss_fn(model(tokens), targets))
            optimizer.step()
            optimizer.zero_grad()
            independent.reset_mod_stats()
    snapshot = independent.get_tracker_snapshot("peak")
    memtracker = max(d["Total"] for d in snapshot.values())
    return {"peak": peak, "between": between, "memtracker": int(memtracker)}


def _loss_against(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    from benchmarks.model import loss_fn

    return loss_fn(logits, targets)


def bench_rows(names: list[str]) -> list[dict[str, Any]]:
    from benchmarks.configs import CONFIGS
    from benchmarks.model import make_batch
    from megatron_fsdp import plan_memory

    rows = []
    for name in names:
        world, _, _, outer, _, checkpointed = BENCH_CASES[name]
        arguments, after = _bench_arguments(name)
        tokens, targets = make_batch(CONFIGS["default"], 0, torch.device("cpu"))
        with torch.device("meta"):
            model = _bench_model(checkpointed)
        started = time.perf_counter()
        plan = plan_memory(
            model,
            world_size=world,
            example_inputs=(tokens,),
            loss_fn=functools.partial(_loss_against, targets=targets),
            outer_dp_size=outer,
            after_wrap=after,
            device="cpu",
            **arguments,
        )
        seconds = time.perf_counter() - started
        ranks = run_distributed(_bench_measured, world, name, timeout=900)
        largest = ranks[plan.rank]
        rows.append(
            {
                "model": f"default {name} ws{world}",
                "device": "cpu",
                "planned": {
                    "peak": plan.peak_bytes,
                    "between": plan.between_steps_bytes,
                    "phase": plan.peak_phase,
                    "seconds": seconds,
                },
                "measured": largest,
            }
        )
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bench", nargs="*", choices=sorted(BENCH_CASES), default=None)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cuda")
    parser.add_argument("--models", nargs="+", choices=sorted(MODELS), default=["953m", "29m"])
    parser.add_argument(
        "--out", type=Path, default=ROOT / "benchmarks" / "results" / "plan_vs_measured.json"
    )
    args = parser.parse_args(argv)
    if args.bench is not None:
        rows = bench_rows(args.bench or sorted(BENCH_CASES))
    else:
        rows = compare(args.models, args.device)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(rows, indent=1))
    print(table(rows))


if __name__ == "__main__":
    main()
