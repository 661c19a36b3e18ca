"""``--profile``: torch.profiler traces of both engines on the same steps, and their digest.

Each rank records ``spec.steps`` steps after a warm-up, with the step's phases and every
engine function labelled (``labels.py``). Rank 0 writes a Chrome trace (open it in Perfetto
or chrome://tracing) and every rank returns per-step figures: the aten ops with the most
self time, the engine functions with their inclusive and self time, and the ops charged to
the engine function that issued them.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.autograd.profiler import record_function
from torch.profiler import ProfilerActivity, profile

from benchmarks.configs import RunSpec
from benchmarks.labels import PREFIX

TOP_OPS = 25


class _PhaseRanges:
    """Turns the step's boundary callbacks into nested ``phase:<name>`` profiler ranges."""

    ORDER = ("forward", "backward", "optimizer", "zero_grad")

    def __init__(self) -> None:
        self._open: contextlib.ExitStack | None = None
        self._next = 0

    def start(self) -> None:
        self._next = 0
        self._enter()

    def _enter(self) -> None:
        self._open = contextlib.ExitStack()
        self._open.enter_context(record_function(f"phase:{self.ORDER[self._next]}"))

    def boundary(self, _phase: str) -> None:
        assert self._open is not None
        self._open.close()
        self._next += 1
        if self._next < len(self.ORDER):
            self._enter()
        else:
            self._open = None


def _row(event: Any, steps: int) -> dict[str, Any]:
    return {
        "name": event.key,
        "calls": event.count / steps,
        "self_ms": event.self_cpu_time_total / 1e3 / steps,
        "total_ms": event.cpu_time_total / 1e3 / steps,
        "self_alloc_mb": max(0, event.self_cpu_memory_usage) / 2**20 / steps,
    }


LABEL_PREFIXES = ("mfsdp::", "fsdp2::", "FSDP::", "phase:")


OTHER_THREAD = "(gloo worker threads)"


def _innermost_label(event: Any, main_thread: int | None) -> str:
    parent = event.cpu_parent
    while parent is not None:
        if parent.name.startswith(LABEL_PREFIXES):
            return str(parent.name)
        parent = parent.cpu_parent
    if main_thread is not None and event.thread != main_thread:
        # On CPU only the collectives' own threads run aten ops off the training thread:
        # ProcessGroupGloo's staging copies and the division of an averaging reduction.
        return OTHER_THREAD
    return "(unlabelled)"


def attribute_ops(prof: profile, steps: int) -> list[dict[str, Any]]:
    """Self time of each aten/c10d op, charged to the innermost engine function around it.

    This is what turns "aten::copy_ is 70 ms" into "ParameterGroup.accumulate_grad spends
    40 ms in aten::copy_": the place in the engine to change.
    """
    totals: dict[tuple[str, str], list[float]] = {}
    events = list(prof.events())  # type: ignore[no-untyped-call]
    main_thread = next((e.thread for e in events if e.name == "step"), None)
    for event in events:
        if not event.name.startswith(("aten::", "c10d::", "fsdp::")):
            continue
        if event.cpu_parent is not None and event.cpu_parent.name.startswith(("aten::", "c10d::")):
            continue  # nested op: already inside its outermost op's inclusive time
        key = (_innermost_label(event, main_thread), event.name)
        entry = totals.setdefault(key, [0.0, 0.0, 0.0])
        entry[0] += event.self_cpu_time_total
        entry[1] += 1
        entry[2] += event.cpu_time_total
    rows: list[dict[str, Any]] = [
        {
            "label": label,
            "op": op,
            "calls": count / steps,
            "self_ms": self_us / 1e3 / steps,
            "total_ms": total_us / 1e3 / steps,
        }
        for (label, op), (self_us, count, total_us) in totals.items()
    ]
    rows.sort(key=lambda r: -r["total_ms"])
    return rows[:TOP_OPS]


def digest(prof: profile, steps: int, impl: str) -> dict[str, Any]:
    """Per-step figures from a finished profile (all times in ms per step)."""
    events = list(prof.key_averages())
    ops = [e for e in events if e.key.startswith(("aten::", "c10d::", "fsdp::", "<built-in"))]
    ops.sort(key=lambda e: -e.self_cpu_time_total)
    prefix = PREFIX.get(impl, "") + "::"
    functions = [e for e in events if prefix != "::" and e.key.startswith(prefix)]
    functions.sort(key=lambda e: -e.cpu_time_total)
    fsdp_labels = [e for e in events if e.key.startswith("FSDP::")]
    fsdp_labels.sort(key=lambda e: -e.cpu_time_total)
    phases = {
        e.key.removeprefix("phase:"): e.cpu_time_total / 1e3 / steps
        for e in events
        if e.key.startswith("phase:")
    }
    steps_ms = [e.cpu_time_total / 1e3 / steps for e in events if e.key == "step"]
    return {
        "steps": steps,
        "step_ms": steps_ms[0] if steps_ms else None,
        "phases": phases,
        "ops": [_row(e, steps) for e in ops[:TOP_OPS]],
        "functions": [_row(e, steps) for e in functions[:TOP_OPS]],
        "builtin_labels": [_row(e, steps) for e in fsdp_labels[:TOP_OPS]],
        "ops_by_label": attribute_ops(prof, steps),
    }


def profile_steps(
    spec: RunSpec, rank: int, run_step: Callable[..., float], device: torch.device
) -> dict[str, Any]:
    """Profile ``spec.steps`` steps on this rank; write its trace into ``spec.profile_dir``."""
    assert spec.profile_dir is not None
    for _ in range(max(spec.warmup, 1)):
        run_step()
    activities = [ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(ProfilerActivity.CUDA)
    ranges = _PhaseRanges()
    dist.barrier()
    with profile(activities=activities, profile_memory=True) as prof:
        for _ in range(spec.steps):
            with record_function("step"):
                ranges.start()
                run_step(ranges.boundary)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
    result = digest(prof, spec.steps, spec.impl)
    if rank == 0:  # the digest is rank 0's; its trace is the one to open next to it
        out = Path(spec.profile_dir)
        out.mkdir(parents=True, exist_ok=True)
        name = f"trace_{spec.model.name}_{spec.precision}_ws{spec.world_size}_{spec.impl}"
        trace = out / f"{name}.json"
        prof.export_chrome_trace(str(trace))
        result["trace"] = str(trace)
    return result
