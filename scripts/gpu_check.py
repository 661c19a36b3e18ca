"""Everything this project can only check on a GPU, in one command, offline, in ~10 minutes.

Run it on a machine with CUDA, a preinstalled torch (2.11 or newer, CUDA build) and pytest,
from the repository root: ``python scripts/gpu_check.py`` (``nox -s gpu`` runs exactly this,
with the machine's own interpreter). Nothing is installed and nothing is downloaded: the
packages are imported from ``packages/*/src``. It runs

1. the tests marked ``cuda`` (side streams with NCCL, NCCL user buffers, the engine's parity
   on CUDA at world 1 for every strategy, Transformer Engine where installed);
2. one benchmark configuration against torch FSDP2 (default model, bf16, world 1);
3. the launch-bound rows (``benchmarks/host_bound.py``: 32 small Llama layers, eager and
   compiled per layer, no sharding / FSDP2 / ours per-module / ours seed, world 1; then
   eager with ``--foreach``);
4. ``plan_memory`` against ``max_memory_allocated`` of the same Llama trained on the GPU
   (``benchmarks/plan_vs_measured.py``: 953M with 4x2048 tokens, and 29M of 32 layers);

and writes ``gpu_report.md`` (and the logs) into ``--out``. Exit status: 0 when every step
passed, 1 when one failed, 2 when there is no CUDA device.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = sorted((ROOT / "packages").glob("*/src"))


def _env() -> dict[str, str]:
    env = dict(os.environ)
    paths = [*(str(p) for p in PACKAGES), str(ROOT), env.get("PYTHONPATH", "")]
    env["PYTHONPATH"] = os.pathsep.join(paths).rstrip(os.pathsep)
    env["PYTHONUNBUFFERED"] = "1"
    return env


def _run(name: str, cmd: list[str], out: Path, timeout_s: int) -> tuple[str, float, str]:
    """Run one step; return its status, its seconds and the last lines of its output."""
    start = time.monotonic()
    log = out / f"{name}.log"
    try:
        done = subprocess.run(
            cmd, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=timeout_s
        )
        text, status = done.stdout + done.stderr, "passed" if done.returncode == 0 else "FAILED"
    except subprocess.TimeoutExpired as exc:
        partial = [p.decode() if isinstance(p, bytes) else p for p in (exc.stdout, exc.stderr)]
        text = "".join(p or "" for p in partial) + f"\n(timed out after {timeout_s} s)"
        status = "TIMED OUT"
    log.write_text(text)
    tail = "\n".join(line for line in text.splitlines()[-12:] if line.strip())
    return status, time.monotonic() - start, tail


def _device_line() -> str:
    import torch

    if not torch.cuda.is_available():
        return ""
    props = torch.cuda.get_device_properties(0)
    return (
        f"{props.name} ({props.total_memory / 2**30:.0f} GiB), torch {torch.__version__}, "
        f"CUDA {torch.version.cuda}, {torch.cuda.device_count()} device(s)"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT / "gpu_check_out")
    parser.add_argument("--skip-bench", action="store_true", help="only the cuda tests")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    device = _device_line()
    report = ["# GPU check", ""]
    if not device:
        report.append("No CUDA device: nothing to check here (the CPU suite covers the rest).")
        (args.out / "gpu_report.md").write_text("\n".join(report) + "\n")
        print(report[-1])
        return 2
    report += [f"- device: {device}", f"- git: {_git_head()}", ""]
    steps = [
        (
            "cuda_tests",
            [
                sys.executable,
                "-m",
                "pytest",
                "-q",
                "-p",
                "no:cacheprovider",
                "-m",
                "cuda",
                "-rs",
                # A test module whose optional import is missing here must not hide the rest.
                "--continue-on-collection-errors",
                "packages",
            ],
            420,
        ),
    ]
    if not args.skip_bench:
        bench = args.out / "bench"
        steps.append(
            (
                "bench_vs_fsdp2",
                [
                    sys.executable,
                    "benchmarks/run.py",
                    "--device",
                    "cuda",
                    "--world-sizes",
                    "1",
                    "--configs",
                    "default",
                    "--precisions",
                    "bf16",
                    "--impls",
                    "ours",
                    "fsdp2",
                    "--reps",
                    "2",
                    "--out",
                    str(bench),
                    "--results-md",
                    str(bench / "RESULTS.md"),
                ],
                150,
            )
        )
        # Issue 50's launch-bound rows: 32 small Llama layers, eager and compiled per layer
        # (inductor), none / FSDP2 / per-module / seed, host ms per phase, ops, entries.
        host_bound = [sys.executable, "-m", "benchmarks.host_bound", "--device", "cuda"]
        host_bound += ["--world-sizes", "1", "--compile", "none", "block"]
        host_bound += ["--out", str(args.out / "host_bound.json")]
        steps.append(("host_bound_vs_fsdp2", host_bound, 240))
        # The same eager with AdamW's foreach form for everyone: on CUDA torch picks foreach
        # by itself only for exact DTensor parameters (FSDP2's), not for our subclass.
        foreach = [sys.executable, "-m", "benchmarks.host_bound", "--device", "cuda", "--foreach"]
        foreach += ["--world-sizes", "1", "--impls", "fsdp2", "per_module", "seed"]
        foreach += ["--out", str(args.out / "host_bound_foreach.json")]
        steps.append(("host_bound_foreach", foreach, 120))
        # Issue 52's rows: the planned peak and bytes between steps against the measured.
        plan = [sys.executable, "-m", "benchmarks.plan_vs_measured", "--device", "cuda"]
        plan += ["--models", "953m", "29m", "--out", str(args.out / "plan_vs_measured.json")]
        steps.append(("plan_vs_measured", plan, 300))
    failed = False
    for name, cmd, timeout_s in steps:
        status, seconds, tail = _run(name, cmd, args.out, timeout_s)
        failed |= status != "passed"
        report += [f"## {name}: {status} ({seconds:.0f} s)", "", "```", tail, "```", ""]
        print(f"{name}: {status} ({seconds:.0f} s)", flush=True)
    (args.out / "gpu_report.md").write_text("\n".join(report))
    print(f"report: {args.out / 'gpu_report.md'}")
    return 1 if failed else 0


def _git_head() -> str:
    try:
        return (
            subprocess.run(
                ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True
            ).stdout.strip()
            or "?"
        )
    except OSError:
        return "?"


if __name__ == "__main__":
    sys.exit(main())
