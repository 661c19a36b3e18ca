"""PNG figures of a run: step time per cell side by side, memory over one step's phases.

matplotlib is imported lazily with the Agg backend, so the benchmark still runs (and says
so) where it is not installed; ``nox -s bench`` installs it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from benchmarks.report import NAMES
from benchmarks.stats import CellSummary

COLORS = {"ours": "#2a7ab9", "fsdp2": "#e07b39", "local": "#9a9a9a"}


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def step_time_plot(cells: list[CellSummary], path: Path) -> Path:
    """Grouped bars per (config, precision), one panel per world size; whiskers: rep range."""
    plt = _pyplot()
    worlds = sorted({c.world_size for c in cells})
    per_row = max(len([c for c in cells if c.world_size == w]) for w in worlds)
    fig, axes = plt.subplots(
        len(worlds), 1, figsize=(max(6.0, 1.6 * per_row + 2), 3.8 * len(worlds)), squeeze=False
    )
    axes = [row[0] for row in axes]
    for ax, world in zip(axes, worlds, strict=True):
        group = [c for c in cells if c.world_size == world]
        impls = [i for i in ("ours", "fsdp2", "local") if any(i in c.impls for c in group)]
        width = 0.8 / len(impls)
        for k, impl in enumerate(impls):
            xs, ys, lo, hi = [], [], [], []
            for x, c in enumerate(group):
                s = c.impls.get(impl)
                if s is None:
                    continue
                xs.append(x + (k - (len(impls) - 1) / 2) * width)
                ys.append(1e3 * s.step_s)
                lo.append(1e3 * (s.step_s - min(s.step_s_reps)))
                hi.append(1e3 * (max(s.step_s_reps) - s.step_s))
            ax.bar(xs, ys, width, yerr=[lo, hi], capsize=3, color=COLORS[impl], label=NAMES[impl])
        for x, c in enumerate(group):
            ratio = c.ratio("step_s")
            top = max(1e3 * s.step_s for s in c.impls.values())
            if ratio is not None:
                ax.annotate(f"{ratio:.2f}x", (x, top), ha="center", va="bottom", fontsize=8)
        ax.set_xticks(range(len(group)), [f"{c.config}\n{c.precision}" for c in group])
        ax.set_ylabel("step time (ms, median)")
        ax.set_title(f"world size {world}  (label: ours/FSDP2)")
        ax.legend(fontsize=8)
        ax.margins(y=0.12)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def memory_phase_plot(cells: list[CellSummary], world: int, path: Path) -> Path | None:
    """Live MiB at each phase boundary (line) and the peak inside each phase (triangles)."""
    group = [
        c for c in cells if c.world_size == world and any(s.memory_phases for s in c.impls.values())
    ]
    if not group:
        return None
    plt = _pyplot()
    configs = list(dict.fromkeys(c.config for c in group))
    precisions = list(dict.fromkeys(c.precision for c in group))
    fig, axes = plt.subplots(
        len(configs),
        len(precisions),
        figsize=(4.6 * len(precisions), 3.2 * len(configs)),
        squeeze=False,
    )
    for c in group:
        ax = axes[configs.index(c.config)][precisions.index(c.precision)]
        for impl in ("ours", "fsdp2"):
            s = c.impls.get(impl)
            if s is None or not s.memory_phases:
                continue
            names = [n for n, _, _ in s.memory_phases]
            xs = range(len(names))
            ax.plot(
                xs,
                [live for _, live, _ in s.memory_phases],
                "-o",
                color=COLORS[impl],
                label=f"{NAMES[impl]} live",
            )
            ax.plot(
                xs[1:],
                [peak for _, _, peak in s.memory_phases[1:]],
                "^",
                color=COLORS[impl],
                alpha=0.6,
                label=f"{NAMES[impl]} peak in phase",
            )
            ax.set_xticks(list(xs), ["start", "fwd", "bwd", "optim", "zero"][: len(names)])
        ax.set_title(f"{c.config} / {c.precision} / ws{world}", fontsize=10)
        ax.set_ylabel("live tensor MiB (per rank)")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def write_plots(cells: list[CellSummary], out: Path) -> list[Path]:
    """All figures into ``out``; an empty list (and a note) when matplotlib is missing."""
    try:
        _pyplot()
    except ImportError:
        print("matplotlib is not installed: skipping plots (pip install matplotlib)")
        return []
    paths = [step_time_plot(cells, out / "step_time.png")]
    for world in sorted({c.world_size for c in cells}):
        path = memory_phase_plot(cells, world, out / f"memory_phases_ws{world}.png")
        if path is not None:
            paths.append(path)
    return paths
