"""Where and with what a run was made, so RESULTS.md figures can be compared honestly."""

from __future__ import annotations

import os
import platform
import subprocess
from pathlib import Path

import torch


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _memory_gib() -> str:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return f"{int(line.split()[1]) / 2**20:.0f} GiB"
    except OSError:
        pass
    return "?"


def _git(root: Path) -> str:
    try:
        head = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=root,
            capture_output=True,
            text=True,
        ).stdout.strip()
    except OSError:
        return "?"
    return f"{head}{' + uncommitted changes' if dirty else ''}" if head else "?"


def describe(root: Path, device_type: str) -> dict[str, str]:
    info = {
        "cpu": f"{_cpu_model()} ({os.cpu_count()} logical cores)",
        "memory": _memory_gib(),
        "os": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "git": _git(root),
    }
    if device_type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(0)
        info["cuda"] = str(torch.version.cuda)
    return info
