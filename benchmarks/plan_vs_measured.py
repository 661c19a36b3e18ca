"""``plan_memory`` against a real run of the same Llama, side by side (issue 52).

For each model (``LlamaConfig``: ``953m``, 16 layers of hidden 2048, 4x2048 tokens;
``29m``, 32 layers of hidden 256; ``tiny`` for a smoke run) the plan is made from the model
on the meta device, then the same model trains for three AdamW steps on one rank
(``fully_shard_model``, bf16 compute, fp32 main weights and reduction): on CUDA the peak of
the last step is ``torch.cuda.max_memory_allocated`` and the bytes between steps
``torch.cuda.memory_allocated`` after ``optimizer.step()``; on a CPU our live-tensor
tracker's. ``python -m benchmarks.plan_vs_measured --device cuda --models 953m 29m`` prints
the table ``scripts/gpu_check.py`` records.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

from mfsdp_collectives.testing import run_distributed

ROOT = Path(__file__).resolve().parents[1]
# name: (hidden, intermediate, layers, heads, vocab, batch, seq)
MODELS = {
    "953m": (2048, 5632, 16, 16, 32000, 4, 2048),
    "29m": (256, 512, 32, 4, 16000, 4, 2048),
    "tiny": (64, 128, 4, 4, 256, 2, 32),
}


def _llama(name: str) -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    hidden, inter, layers, heads, vocab, _, _ = MODELS[name]
    config = LlamaConfig(
        hidden_size=hidden,
        intermediate_size=inter,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        vocab_size=vocab,
        max_position_embeddings=4096,
        use_cache=False,
    )
    model: nn.Module = LlamaForCausalLM(config)
    return model


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
    lines = [
        "| model | device | planned peak | measured peak | error | planned between | "
        "measured between | error | planned in |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        p, m = row["planned"], row["measured"]
        mib = 2**20
        lines.append(
            f"| {row['model']} | {row['device']} | {p['peak'] / mib:,.0f} MiB "
            f"| {m['peak'] / mib:,.0f} MiB | {p['peak'] / m['peak'] - 1:+.1%} "
            f"| {p['between'] / mib:,.0f} MiB | {m['between'] / mib:,.0f} MiB "
            f"| {p['between'] / m['between'] - 1:+.1%} | {p['seconds']:.1f} s |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cuda")
    parser.add_argument("--models", nargs="+", choices=sorted(MODELS), default=["953m", "29m"])
    parser.add_argument(
        "--out", type=Path, default=ROOT / "benchmarks" / "results" / "plan_vs_measured.json"
    )
    args = parser.parse_args(argv)
    rows = compare(args.models, args.device)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(rows, indent=1))
    print(table(rows))


if __name__ == "__main__":
    main()
