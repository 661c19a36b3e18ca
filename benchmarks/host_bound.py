"""Launch-bound training, eager and compiled per block: ours vs FSDP2 vs no sharding.

A Llama of many small decoder layers (``LlamaConfig``, hidden 64, 32 layers by default)
spends its step on what the host issues, not on arithmetic: the case where an FSDP's hooks,
per-parameter work and DTensor dispatches decide the step time (issue 50). Every
implementation runs in its own process world, one after another, in one invocation:

* ``none``: the model unwrapped (each rank alone, no communication: the floor);
* ``fsdp2``: torch's ``fully_shard`` on each layer, then the root, ``torch.optim.AdamW``
  (``--foreach``: its foreach form; ``--clip-grad-norm``: ``clip_grad_norm_`` before each step,
  timed with the optimizer);
* ``per_module``: ``mfsdp_hooks.fully_shard`` the same way, the same optimizer;
* ``seed``: ``megatron_fsdp.fully_shard(model, optimizer)`` (contiguous optimizer step).

``--compile block`` compiles each decoder layer before sharding, as torchtitan does
(``torch.compile(layer)`` put back into the model; ``--backend``, default inductor).

Per world: median host seconds of forward, backward and optimizer step (+ ``zero_grad``)
over ``--steps`` steps after ``--warmup``; then one step counted (not timed): aten ops
dispatched and entries into the engine (``mfsdp_hooks.testing.host_counts``); on CUDA the
peak memory allocated, on CPU the rank process's peak resident set (each implementation runs
in processes of its own; a dispatch-mode tracker would miss what compiled code allocates).
``python -m benchmarks.host_bound --world-sizes 1 2 --compile none block`` writes
``benchmarks/results/host_bound.json`` and prints the markdown table.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

from benchmarks.llama import llama, markdown_table
from mfsdp_collectives.testing import run_distributed

ROOT = Path(__file__).resolve().parents[1]
IMPLS = ("none", "fsdp2", "per_module", "seed")


def _wrap(
    impl: str, model: nn.Module, device: torch.device, foreach: bool | None
) -> tuple[nn.Module, torch.optim.Optimizer]:
    layers = list(model.model.layers)  # type: ignore[union-attr,arg-type]
    if impl in ("fsdp2", "per_module"):
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard as fsdp2_shard

        from mfsdp_hooks import fully_shard as our_shard

        shard: Any = fsdp2_shard if impl == "fsdp2" else our_shard
        mesh = init_device_mesh(device.type, (torch.distributed.get_world_size(),))
        for layer in layers:
            shard(layer, mesh=mesh)
        shard(model, mesh=mesh)
    if impl == "seed":
        from transformers.models.llama.modeling_llama import LlamaDecoderLayer

        import megatron_fsdp

        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=foreach)
        return megatron_fsdp.fully_shard(model, optimizer, fsdp_unit_modules=[LlamaDecoderLayer])
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=foreach)


def _engine_dirs(impl: str) -> tuple[str, ...]:
    """The implementation's code and the DTensor layer it hands the optimizer (as
    test_megatron_fsdp_host_counts counts: each DTensor op enters Python there or in ours)."""
    import torch.distributed.tensor as dtensor

    from mfsdp_hooks.testing.host_counts import package_dirs

    if impl == "none":
        return ()
    if impl == "fsdp2":
        import torch.distributed.fsdp._fully_shard as fsdp2

        return package_dirs([fsdp2, dtensor])
    import megatron_fsdp
    import mfsdp_buffers
    import mfsdp_checkpoint
    import mfsdp_collectives
    import mfsdp_hooks

    layers = [mfsdp_buffers, mfsdp_collectives, mfsdp_hooks, mfsdp_checkpoint, megatron_fsdp]
    return package_dirs([*layers, dtensor])


def _world(rank: int, world: int, impl: str, args: dict[str, Any]) -> dict[str, Any]:
    from mfsdp_hooks.testing.host_counts import AtenOpCount, engine_entries

    torch.set_num_threads(1)
    cuda = args["device"] == "cuda"
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    torch.manual_seed(0)
    model = llama(64, 128, args["layers"], 4, 256, max_positions=128).to(device)
    if args["compile"] == "block":
        stack: nn.ModuleList = model.model.layers  # type: ignore[union-attr,assignment]
        for index, layer in enumerate(stack):
            stack[index] = torch.compile(layer, backend=args["backend"])  # type: ignore[assignment]
    wrapped, optimizer = _wrap(impl, model, device, args["foreach"])
    clip = args["clip_grad_norm"]
    generator = torch.Generator().manual_seed(rank)
    ids = torch.randint(0, 256, (args["batch"], args["seq"]), generator=generator).to(device)

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize()

    def step() -> tuple[float, float, float]:
        t0 = time.perf_counter()
        loss = wrapped(input_ids=ids, labels=ids).loss
        sync()
        t1 = time.perf_counter()
        loss.backward()
        sync()
        t2 = time.perf_counter()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(wrapped.parameters(), clip)
        optimizer.step()
        optimizer.zero_grad()
        sync()
        return t1 - t0, t2 - t1, time.perf_counter() - t2

    for _ in range(args["warmup"]):
        step()
    phases = [step() for _ in range(args["steps"])]
    out: dict[str, Any] = {
        name: statistics.median(p[i] for p in phases) * 1e3
        for i, name in enumerate(("forward_ms", "backward_ms", "optimizer_ms"))
    }
    out["step_ms"] = statistics.median(sum(p) for p in phases) * 1e3
    with AtenOpCount() as counted:
        step()
    out["aten_ops"] = counted.ops
    out["engine_entries"] = sum(engine_entries(step, _engine_dirs(impl)).values())
    if cuda:
        out["peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
    else:
        out["peak_rss_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return out


def measure(args: dict[str, Any]) -> list[dict[str, Any]]:
    rows = []
    backend = "nccl" if args["device"] == "cuda" else "gloo"
    for world in args["world_sizes"]:
        for mode in args["compile"]:
            for impl in args["impls"]:
                spec = dict(args, compile=mode)
                ranks = run_distributed(
                    _world, world, impl, spec, timeout=args["timeout"], backend=backend
                )
                rows.append({"world": world, "compile": mode, "impl": impl, **ranks[0]})
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    """Markdown: one row per world x compile x implementation, ratios to FSDP2's step."""
    columns = ["world", "compile", "impl", "forward ms", "backward ms", "optimizer ms"]
    columns += ["step ms", "vs FSDP2", "aten ops", "engine entries", "peak memory"]
    cells = []
    for row in rows:
        fsdp2 = next(
            (
                r
                for r in rows
                if r["impl"] == "fsdp2"
                and r["world"] == row["world"]
                and r["compile"] == row["compile"]
            ),
            None,
        )
        ratio = f"{row['step_ms'] / fsdp2['step_ms']:.2f}x" if fsdp2 else "-"
        cells.append(
            [str(row[key]) for key in ("world", "compile", "impl")]
            + [f"{row[key]:.1f}" for key in ("forward_ms", "backward_ms", "optimizer_ms")]
            + [f"{row['step_ms']:.1f}", ratio, str(row["aten_ops"]), str(row["engine_entries"])]
            + [_peak(row)]
        )
    return markdown_table(columns, cells)


def _peak(row: dict[str, Any]) -> str:
    if "peak_gib" in row:
        return f"{row['peak_gib']:.2f} GiB"
    return f"{row['peak_rss_mib']:.0f} MiB RSS" if "peak_rss_mib" in row else "-"


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--world-sizes", nargs="+", type=int, default=[1, 2])
    p.add_argument("--compile", nargs="+", choices=("none", "block"), default=["none"])
    p.add_argument("--backend", default="inductor", help="torch.compile backend")
    p.add_argument("--impls", nargs="+", choices=IMPLS, default=list(IMPLS))
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--seq", type=int, default=32)
    p.add_argument("--steps", type=int, default=15)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument(
        "--foreach", action="store_true", default=None, help="AdamW(foreach=True) for every impl"
    )
    p.add_argument(
        "--clip-grad-norm", type=float, default=None, help="clip_grad_norm_ before each step"
    )
    p.add_argument("--timeout", type=float, default=900.0)
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "host_bound.json")
    args = vars(p.parse_args(argv))
    out = args.pop("out")
    rows = measure(args)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"args": args, "rows": rows}, indent=1))
    print(table(rows))


if __name__ == "__main__":
    main()
