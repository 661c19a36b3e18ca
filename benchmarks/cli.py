"""``python benchmarks/run.py``: plan the worlds, run them, write every output.

See ``plan.py`` for the order (A B A B per cell, fresh worlds) and ``outputs.py`` for what
is written where.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks.configs import CONFIGS, IMPLS, PRECISIONS, RunSpec
from benchmarks.outputs import Outputs
from benchmarks.plan import Settings, benchmark_worlds, profile_worlds
from benchmarks.report import NAMES
from benchmarks.stats import RepResult

ROOT = Path(__file__).resolve().parents[1]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python benchmarks/run.py",
        description="megatron-fsdp vs torch FSDP2 (ZeRO-3), side by side.",
    )
    p.add_argument(
        "--world-sizes",
        type=int,
        nargs="+",
        default=None,
        help="default: 2 4 on CPU (gloo), 1 on CUDA (nccl); --quick: 2",
    )
    p.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    p.add_argument("--precisions", nargs="+", default=list(PRECISIONS), choices=PRECISIONS)
    p.add_argument(
        "--impls",
        nargs="+",
        default=list(IMPLS),
        choices=IMPLS,
        help="implementations to run, in this order inside each repetition",
    )
    p.add_argument("--reps", type=int, default=3, help="worlds per implementation per cell")
    p.add_argument("--steps", type=int, default=5, help="timed steps per world")
    p.add_argument("--warmup", type=int, default=1, help="untimed steps before the timed ones")
    p.add_argument(
        "--quick",
        action="store_true",
        help="smoke run: tiny models, 1 rep, 3 steps; writes <out>/quick, not RESULTS.md",
    )
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    p.add_argument(
        "--results-md",
        type=Path,
        default=None,
        help="where to write RESULTS.md (default benchmarks/RESULTS.md; --quick: not written)",
    )
    p.add_argument(
        "--profile",
        action="store_true",
        help="also profile ours, FSDP2 and the reference (default config, first world size)",
    )
    p.add_argument("--profile-steps", type=int, default=3)
    p.add_argument(
        "--grad-allocator",
        choices=("plain", "double_buffer", "trace_pool"),
        default="plain",
        help="ours: allocator of the gradient reduce buffers (one instance shared by all units)",
    )
    p.add_argument(
        "--host-transport",
        choices=("auto", "shm", "gloo"),
        default="auto",
        help="ours on CPU: shared-memory collectives between the ranks of this host, or gloo's",
    )
    p.add_argument(
        "--backward-prefetch-fraction",
        type=float,
        default=0.5,
        help="ours: backward_prefetch_grad_fraction (0.0 = FSDP2's pre-backward timing)",
    )
    p.add_argument(
        "--prefetch-depth", type=int, default=1, help="ours: units gathered ahead (>= 1)"
    )
    p.add_argument(
        "--merge-blocks",
        type=int,
        default=0,
        help="ours: gather N blocks ahead as one all-gather (suggested_communication_unit_size)",
    )
    p.add_argument(
        "--quantize-comms",
        choices=("none", "grads", "grads+weights"),
        default="none",
        help="ours: int8 block-quantized reduce-scatters (and all-gathers), 2048-value blocks",
    )
    p.add_argument(
        "--serial-reductions",
        action="store_true",
        help="ours, shared memory: reduce-scatters wait behind all-gathers (one worker lane)",
    )
    p.add_argument(
        "--reshard-after-forward",
        type=int,
        default=0,
        help="both: keep each block's weights over N consecutive ranks from forward to backward",
    )
    p.add_argument(
        "--hsdp-outer",
        type=int,
        default=1,
        help="replicas across dp_outer, both implementations: 2 with 4 ranks is HSDP on 2x2",
    )
    p.add_argument(
        "--tp",
        type=int,
        default=1,
        help="both: cut every block's MLP over N TP ranks (torch DTensor TP), FSDP over the rest",
    )
    p.add_argument(
        "--float8",
        action="store_true",
        help="both, fp32: torchao float8 Linear layers in the blocks, float8 all-gather",
    )
    p.add_argument(
        "--outer-optim",
        action="store_true",
        help="ours, with --hsdp-outer: HFSDP (optimizer state sharded across dp_outer too)",
    )
    p.add_argument(
        "--optimizer-step",
        choices=("contiguous", "per-param"),
        default="contiguous",
        help="ours: AdamW through fully_shard_optimizer's contiguous step, or torch's own loop",
    )
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds per world")
    args = p.parse_args(argv)
    if args.reps < 1 or args.steps < 1 or args.warmup < 0:
        p.error("need --reps >= 1, --steps >= 1, --warmup >= 0")
    if args.prefetch_depth < 1:
        p.error("--prefetch-depth must be >= 1")
    if args.merge_blocks < 0:
        p.error("--merge-blocks must be >= 0")
    if not 0.0 <= args.backward_prefetch_fraction <= 1.0:
        p.error("--backward-prefetch-fraction must be in [0, 1]")
    return args


def _device_and_worlds(args: argparse.Namespace) -> tuple[str, list[int]]:
    device = args.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device is available")
    worlds = args.world_sizes or ([1] if device == "cuda" else [2] if args.quick else [2, 4])
    if device == "cuda":
        usable = [w for w in worlds if w <= torch.cuda.device_count()]
        for w in sorted(set(worlds) - set(usable)):
            print(f"skipping world size {w}: only {torch.cuda.device_count()} CUDA device(s)")
        worlds = usable
    if not worlds or min(worlds) < 1:
        raise SystemExit(f"no usable world size in {worlds}")
    return device, worlds


def _launch(fn: Any, world: int, args: argparse.Namespace, backend: str, *fn_args: Any) -> Any:
    from mfsdp_collectives.testing import run_distributed

    return run_distributed(
        fn,
        world,
        *fn_args,
        timeout=args.timeout,
        backend=backend,
        env={"OMP_NUM_THREADS": str(args.threads)},
    )


def _run_world(spec: RunSpec, args: argparse.Namespace, rep: int) -> RepResult:
    from benchmarks.worker import bench_rank

    start = time.perf_counter()
    backend = "nccl" if spec.device_type == "cuda" else "gloo"
    ranks = _launch(bench_rank, spec.world_size, args, backend, spec)
    return RepResult(spec, rep, ranks, time.perf_counter() - start)


def _progress(done: int, total: int, start: float, result: RepResult, reps: int) -> None:
    s = result.spec
    times = [max(t) for t in zip(*(r.step_times for r in result.ranks), strict=True)]
    what = f"{1e3 * sorted(times)[len(times) // 2]:7.0f} ms/step" if times else "   profiled"
    print(
        f"[{done:3d}/{total} {(time.perf_counter() - start) / 60:5.1f} min] {s.model.name}/"
        f"{s.precision}/ws{s.world_size} rep {result.rep + 1}/{reps} {NAMES[s.impl]:13s} "
        f"{what}  (world {result.wall_s:.1f} s)",
        flush=True,
    )


def _collective_speed(
    args: argparse.Namespace, results: list[RepResult]
) -> dict[str, dict[str, float]]:
    """Pure all-gather/reduce-scatter timings at the profiled cells' average call sizes."""
    from benchmarks.gloo_bw import collective_speed

    speeds: dict[str, dict[str, float]] = {}
    for r in results:
        s = r.spec
        comm = r.ranks[0].comm
        if s.impl != "ours" or not r.ranks[0].memory or s.device_type != "cpu" or not comm:
            continue
        key = f"{s.model.name}/{s.precision}/ws{s.world_size}"
        if key in speeds or not any(
            p.spec.profile_dir
            and p.spec.model == s.model
            and p.spec.precision == s.precision
            and p.spec.world_size == s.world_size
            for p in results
        ):
            continue
        ag, rs = comm.get("all_gather"), comm.get("reduce_scatter")
        if not ag or not rs:
            continue
        dtype = "bfloat16" if s.precision == "bf16" else "float32"
        speeds[key] = _launch(
            collective_speed,
            s.world_size,
            args,
            "gloo",
            ag["bytes"] // ag["calls"],
            rs["bytes"] // rs["calls"],
            dtype,
        )[0]
    return speeds


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    device, worlds = _device_and_worlds(args)
    settings = Settings.resolve(args, device, worlds)
    out = args.out / "quick" if args.quick else args.out
    out.mkdir(parents=True, exist_ok=True)
    plan = benchmark_worlds(args, settings)
    profiled = [(0, s) for s in profile_worlds(args, settings, str(out / "profile"))]
    print(
        f"{len(plan)} benchmark worlds + {len(profiled)} profiled on {device}, world sizes "
        f"{worlds}, torch {torch.__version__}",
        flush=True,
    )
    start = time.perf_counter()
    results: list[RepResult] = []
    failures: list[str] = []
    for done, (rep, spec) in enumerate([*plan, *profiled], start=1):
        try:
            result = _run_world(spec, args, rep)
        except Exception as exc:  # keep going: one broken world must not lose the others
            failures.append(f"{spec.label} rep {rep + 1}: {exc}")
            print(f"FAILED {spec.label} rep {rep + 1}: {str(exc).splitlines()[0]}", flush=True)
            continue
        results.append(result)
        _progress(done, len(plan) + len(profiled), start, result, settings.reps)
    speeds = _collective_speed(args, results) if profiled else {}
    words = sys.argv[1:] if argv is None else argv
    outputs = Outputs(
        root=ROOT,
        out=out,
        results=results,
        failures=failures,
        speeds=speeds,
        argv=words,
        settings=settings.describe(args.threads, args.optimizer_step),
        wall_s=time.perf_counter() - start,
    )
    results_md = args.results_md
    if results_md is None and not args.quick:
        results_md = ROOT / "benchmarks" / "RESULTS.md"
    ok = outputs.write(results_md)
    return 0 if ok and not failures else 1
