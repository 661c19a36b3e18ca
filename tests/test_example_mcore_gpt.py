"""examples/mcore_gpt.py end to end: Megatron-Core's real ``GPTModel`` trained through
``megatron_fsdp.mcore.FullyShardedDataParallel`` on 2 CPU ranks under torchrun matches the
same model trained unsharded in one process. Needs megatron-core (``nox -s mcore`` installs
it); skipped elsewhere."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("megatron.core", reason="megatron-core is not installed (nox -s mcore)")

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "mcore_gpt.py"
STEPS = 12


def _run(*launcher: str, losses: Path, extra: tuple[str, ...] = ()) -> list[float]:
    command = [*launcher, str(EXAMPLE), "--steps", str(STEPS), "--losses-out", str(losses)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run([*command, *extra], capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    loaded: list[float] = json.loads(losses.read_text())
    return loaded


def test_mcore_gpt_on_two_ranks_matches_one_process(tmp_path: Path) -> None:
    torchrun = (sys.executable, "-m", "torch.distributed.run", "--standalone")
    sharded = _run(*torchrun, "--nproc-per-node", "2", losses=tmp_path / "sharded.json")
    reference = _run(sys.executable, losses=tmp_path / "ref.json", extra=("--reference",))
    assert len(sharded) == len(reference) == STEPS
    for step, (ours, theirs) in enumerate(zip(sharded, reference, strict=True), start=1):
        assert abs(ours - theirs) <= 1e-5 * abs(theirs), (step, sharded, reference)
    assert sharded[-1] < 0.9 * sharded[0], sharded
