"""examples/hf_trainer.py end to end under torchrun on 2 CPU ranks: Trainer with
MegatronFSDPTrainer trains, checkpoints, is started again with ``--resume`` for more steps,
and its ``save_model()`` output loads with ``from_pretrained`` to the sharded logits."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from example_runs import run_example

pytest.importorskip("transformers")
pytest.importorskip("accelerate")


def _run(out: Path, *args: str) -> str:
    done = run_example("hf_trainer.py", "--output-dir", str(out), "--save-steps", "10", *args)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done.stdout


def _losses(stdout: str) -> list[float]:
    return [float(v) for v in re.findall(r"'loss': '([0-9.]+)'", stdout)]


def test_trains_resumes_and_saves_what_from_pretrained_loads(tmp_path: Path) -> None:
    first = _run(tmp_path, "--steps", "20")
    assert (tmp_path / "checkpoint-20" / "megatron_fsdp" / "mfsdp_checkpoint.json").is_file()
    resumed = _run(tmp_path, "--steps", "30", "--resume", "--api", "per_module")
    assert _losses(first)[-1] < _losses(first)[0], first
    assert len(_losses(resumed)) == 1, resumed  # steps 21-30 only: it resumed at 20
    assert "max |logit difference| 0.00e+00" in resumed, resumed[-2000:]
    assert (tmp_path / "final" / "config.json").is_file()
