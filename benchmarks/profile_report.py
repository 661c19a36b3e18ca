"""The profile digest in markdown: phases, engine functions, ops charged to engine functions,
and the pure-collective floor measured on the same machine."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from benchmarks.report import NAMES

PHASES = ("forward", "backward", "optimizer", "zero_grad")


def _f(value: float | None, fmt: str = "{:.1f}") -> str:
    return "-" if value is None else fmt.format(value)


def _phase_table(profiles: dict[str, dict[str, Any]], impls: Sequence[str]) -> str:
    rows = [
        "| phase | " + " | ".join(NAMES[i] for i in impls) + " |",
        "|---|" + "---|" * len(impls),
    ]
    for phase in PHASES:
        rows.append(
            f"| {phase} | " + " | ".join(_f(profiles[i]["phases"].get(phase)) for i in impls) + " |"
        )
    rows.append("| **step** | " + " | ".join(_f(profiles[i].get("step_ms")) for i in impls) + " |")
    return "\n".join(rows)


def _function_table(entries: list[dict[str, Any]], limit: int) -> str:
    rows = ["| engine function | calls | inclusive ms | self ms |", "|---|---|---|---|"]
    for e in entries[:limit]:
        rows.append(
            f"| `{e['name']}` | {e['calls']:.0f} | {e['total_ms']:.1f} | {e['self_ms']:.1f} |"
        )
    return "\n".join(rows)


def _charged_table(entries: list[dict[str, Any]], limit: int) -> str:
    rows = ["| innermost engine function | op | calls | ms (inclusive) |", "|---|---|---|---|"]
    for e in entries[:limit]:
        rows.append(f"| `{e['label']}` | `{e['op']}` | {e['calls']:.0f} | {e['total_ms']:.1f} |")
    return "\n".join(rows)


def _op_diff(profiles: dict[str, dict[str, Any]], impls: Sequence[str], limit: int) -> str:
    table: dict[str, dict[str, dict[str, Any]]] = {}
    for impl in impls:
        for op in profiles[impl]["ops"]:
            table.setdefault(op["name"], {})[impl] = op
    order = sorted(
        table, key=lambda n: -max(table[n].get(i, {"self_ms": 0.0})["self_ms"] for i in impls)
    )[:limit]
    rows = [
        "| op | " + " | ".join(f"{NAMES[i]}: self ms (calls, alloc MiB)" for i in impls) + " |",
        "|---|" + "---|" * len(impls),
    ]
    for name in order:
        cells = []
        for impl in impls:
            e = table[name].get(impl)
            cells.append(
                "-"
                if e is None
                else f"{e['self_ms']:.1f} ({e['calls']:.0f}, {e['self_alloc_mb']:.0f})"
            )
        rows.append(f"| `{name[:60]}` | " + " | ".join(cells) + " |")
    return "\n".join(rows)


def _floor(speed: dict[str, float] | None, comm: dict[str, dict[str, int]]) -> str:
    if not speed or not comm:
        return ""
    ag, rs = comm.get("all_gather", {}), comm.get("reduce_scatter", {})
    floor = (
        ag.get("calls", 0) * speed["all_gather_ms"]
        + rs.get("calls", 0) * speed["reduce_scatter_ms"]
    )
    return (
        f"Pure collectives on this machine (gloo, nothing else running): one all-gather of "
        f"the average per-call shard takes {speed['all_gather_ms']:.1f} ms "
        f"({speed['all_gather_gbps']:.2f} GB/s sent per rank), one reduce-scatter of the "
        f"average per-call input {speed['reduce_scatter_ms']:.1f} ms "
        f"({speed['reduce_scatter_gbps']:.2f} GB/s); the step's {ag.get('calls', 0)} "
        f"all-gathers and {rs.get('calls', 0)} reduce-scatters therefore need >= "
        f"**{floor:.0f} ms** of collective time per step, which overlaps compute only where "
        "spare cores exist."
    )


def profile_markdown(
    label: str,
    profiles: dict[str, dict[str, Any]],
    speed: dict[str, float] | None,
    comm: dict[str, dict[str, int]],
    limit: int = 12,
) -> str:
    impls = [i for i in ("ours", "fsdp2", "local") if i in profiles]
    engines = [i for i in ("ours", "fsdp2") if i in profiles]
    parts = [
        f"### {label} (rank 0, ms per step under the profiler)",
        "",
        _phase_table(profiles, impls),
        "",
    ]
    floor = _floor(speed, comm)
    if floor:
        parts += [floor, ""]
    for impl in engines:
        parts += [
            f"**{NAMES[impl]}: engine functions by inclusive time**",
            "",
            _function_table(profiles[impl]["functions"], limit),
            "",
            f"**{NAMES[impl]}: where the ops run** (top-level aten/c10d ops charged to the "
            "innermost engine function or phase around them)",
            "",
            _charged_table(profiles[impl]["ops_by_label"], limit),
            "",
        ]
    parts += [
        "**aten/c10d ops by self time** (ms per step)",
        "",
        _op_diff(profiles, impls, limit),
    ]
    return "\n".join(parts)
