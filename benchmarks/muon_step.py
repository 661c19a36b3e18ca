"""Muon on sharded parameters: step time and bytes against the ideal, against AdamW.

A Llama from ``LlamaConfig`` (hidden 256, 4 layers by default); the decoder layers' matrices
take Muon, the rest (embeddings, norms, the head) AdamW in a ``use_muon=False`` group, as
Muon users configure it. Per world size, in its own process world:

* ``one_process`` (world 1 only): ``torch.optim.Muon`` + ``torch.optim.AdamW`` unwrapped;
* ``muon``: ``megatron_fsdp.fully_shard(model, megatron_fsdp.Muon(groups))``;
* ``adamw``: the same with ``torch.optim.AdamW`` over everything (the contiguous step).

Median host seconds of ``optimizer.step()`` over ``--steps`` steps after ``--warmup`` (each
after a real forward and backward), and the bytes this rank's step sends
(``CommTracer``'s ``all_to_all``), summed over ranks, beside the ideal: each matrix's rows
that its owner does not hold sent there once in the parameter's dtype, and the owner's
result sent back once in bfloat16 (``ideal_bytes``); and beside the bound of a matrix sent
whole each way (``numel * (4 + 2)``). ``python -m benchmarks.muon_step --world-sizes 1 2 4``
writes ``benchmarks/results/muon_step.json`` and prints the markdown table.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from mfsdp_collectives import CommTracer
from mfsdp_collectives.testing import run_distributed

ROOT = Path(__file__).resolve().parents[1]


def _model(args: dict[str, Any]) -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    hidden = args["hidden"]
    config = LlamaConfig(
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=args["layers"],
        num_attention_heads=4,
        num_key_value_heads=4,
        vocab_size=512,
        max_position_embeddings=128,
        use_cache=False,
    )
    model: nn.Module = LlamaForCausalLM(config)
    return model


def _is_hidden(name: str, param: torch.Tensor) -> bool:
    return ".layers." in f".{name}" and param.ndim == 2


def _optimizer(kind: str, model: nn.Module) -> Any:
    import megatron_fsdp

    named = list(model.named_parameters())
    hidden = [p for n, p in named if _is_hidden(n, p)]
    rest = [p for n, p in named if not _is_hidden(n, p)]
    if kind == "adamw":
        return torch.optim.AdamW(model.parameters(), lr=1e-3)
    if kind == "one_process":
        return [torch.optim.Muon(hidden, lr=2e-2), torch.optim.AdamW(rest, lr=1e-3)]
    groups = [{"params": hidden}, {"params": rest, "use_muon": False, "lr": 1e-3}]
    return megatron_fsdp.Muon(groups, lr=2e-2)


def _ideal_bytes(model: nn.Module, optimizer: Any) -> tuple[int, int]:
    """(this rank's share of the ideal, numel * 6 of the matrices): each matrix's rows its
    owner lacks, once there (float32) and once back (bfloat16), split by holder."""
    from mfsdp_hooks import newton_schulz_cost, plan_owners, rows_of

    params = [p for g in optimizer.param_groups if g.get("use_muon", True) for p in g["params"]]
    layouts = [rows_of(p, "p") for p in params]
    whole = sum(p.numel() * 6 for p in params)
    if not layouts or layouts[0].group is None:
        return 0, whole
    group = layouts[0].group
    rank, size = dist.get_rank(group), dist.get_world_size(group)
    owners = plan_owners([newton_schulz_cost(layout.shape) for layout in layouts], size)
    mine = 0
    for layout, owner in zip(layouts, owners, strict=True):
        row = layout.shape.numel() // layout.shape[layout.dim]
        held = [(end - start) * row for start, end in layout.ranges]
        if owner == rank:  # the results it sends back
            mine += 2 * (layout.shape.numel() - held[rank])
        else:  # its rows, sent to the owner
            mine += 4 * held[rank]
    return mine, whole


def _world(rank: int, world: int, kind: str, args: dict[str, Any]) -> dict[str, Any]:
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    import megatron_fsdp

    torch.set_num_threads(1)
    model = _model(args)
    optimizer = _optimizer(kind, model)
    step_model: nn.Module = model
    if kind != "one_process":
        step_model, optimizer = megatron_fsdp.fully_shard(
            model, optimizer, fsdp_unit_modules=[LlamaDecoderLayer]
        )
    optimizers = optimizer if isinstance(optimizer, list) else [optimizer]
    ids = torch.randint(0, 512, (2, 64), generator=torch.Generator().manual_seed(rank))
    times, sent = [], 0
    for _ in range(args["warmup"] + args["steps"]):
        step_model(input_ids=ids, labels=ids).loss.backward()
        with CommTracer() as tracer:
            start = time.perf_counter()
            for each in optimizers:
                each.step()
            times.append(time.perf_counter() - start)
        sent = tracer.bytes("all_to_all")
        for each in optimizers:
            each.zero_grad()
    ideal, whole = _ideal_bytes(step_model, optimizers[0]) if kind == "muon" else (0, 0)
    return {
        "step_ms": 1000 * statistics.median(times[args["warmup"] :]),
        "sent": sent,
        "ideal": ideal,
        "whole": whole,
    }


def measure(args: dict[str, Any]) -> list[dict[str, Any]]:
    rows = []
    for world in args["world_sizes"]:
        for kind in ("one_process", "muon", "adamw"):
            if kind == "one_process" and world != 1:
                continue
            ranks = run_distributed(_world, world, kind, args, timeout=900)
            rows.append(
                {
                    "world": world,
                    "optimizer": kind,
                    "step_ms": round(max(r["step_ms"] for r in ranks), 2),
                    "bytes": sum(r["sent"] for r in ranks),
                    "ideal_bytes": sum(r["ideal"] for r in ranks),
                    "whole_bytes": ranks[0]["whole"],
                }
            )
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| world | optimizer | step ms | bytes / step | ideal bytes | bytes / ideal |",
        "|---|---|---|---|---|---|",
    ]
    for row in rows:
        ratio = f"{row['bytes'] / row['ideal_bytes']:.2f}" if row["ideal_bytes"] else "-"
        lines.append(
            f"| {row['world']} | {row['optimizer']} | {row['step_ms']} | {row['bytes']} | "
            f"{row['ideal_bytes']} | {ratio} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--world-sizes", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "muon_step.json")
    parsed = p.parse_args(argv)
    args = vars(parsed) | {"out": str(parsed.out)}
    rows = measure(args)
    parsed.out.parent.mkdir(parents=True, exist_ok=True)
    parsed.out.write_text(json.dumps({"args": args, "rows": rows}, indent=2))
    print(table(rows))


if __name__ == "__main__":
    main()
