"""Run one of ``examples/`` as a user does: under torchrun on 2 CPU ranks."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run_example(script: str, *args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    """``torchrun --standalone --nproc-per-node 2 examples/<script> <args>``, one torch thread
    a rank and no progress bars; the finished process (check its return code)."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    command += ["--nproc-per-node", "2", str(ROOT / "examples" / script), *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TQDM_DISABLE": "1"}
    return subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=env)
