"""examples/train_gpt.py (the main job) on 2 CPU ranks under torchrun: int8 block-quantized
gradient reduce-scatters train the demo GPT to the loss of fp32 ones (issue 33: within 1% of
the final loss, no step more than 2% off, over the demo's 150 steps)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from example_runs import run_example

FULL = os.environ.get("MFSDP_FULL_MATRIX") == "1"


def _losses(out: Path, name: str, *args: str) -> tuple[list[float], float]:
    """Every step's loss (mean over the ranks) and the held-out loss of one demo run."""
    path = out / f"{name}.json"
    done = run_example("train_gpt.py", "--losses", str(path), *args, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    record = json.loads(path.read_text())
    return record["losses"], record["held_out"]


def _relative(ours: list[float], reference: list[float]) -> list[float]:
    return [abs(a - b) / b for a, b in zip(ours, reference, strict=True)]


def test_the_first_steps_with_int8_gradients_track_fp32(tmp_path: Path) -> None:
    small = ("--steps", "12", "--width", "64", "--depth", "2", "--log-every", "4")
    fp32, _ = _losses(tmp_path, "fp32", *small)
    int8, _ = _losses(tmp_path, "int8", *small, "--quantize-comms", "grads")
    assert len(fp32) == len(int8) == 12
    assert fp32[-1] < fp32[0] - 0.2, fp32  # it learns, so tracking it means something
    assert fp32 != int8  # the gradients did go through the int8 codec
    assert max(_relative(int8, fp32)) < 2e-3, (int8, fp32)


@pytest.mark.skipif(not FULL, reason="MFSDP_FULL_MATRIX=1 (nox -s tests_full): two 40 s runs")
def test_int8_gradients_end_the_demo_within_one_percent_of_fp32(tmp_path: Path) -> None:
    fp32, fp32_held_out = _losses(tmp_path, "fp32")
    int8, int8_held_out = _losses(tmp_path, "int8", "--quantize-comms", "grads")
    assert len(fp32) == len(int8) == 150
    assert fp32[-1] < 0.3 * fp32[0], fp32  # the demo learns its grammar
    relative = _relative(int8, fp32)
    assert relative[-1] <= 0.01, (int8[-1], fp32[-1])
    assert max(relative) <= 0.02, max(relative)
    assert abs(int8_held_out - fp32_held_out) <= 0.01 * fp32_held_out


def test_the_demo_trains_with_muon(tmp_path: Path) -> None:
    """``--optimizer muon``: megatron_fsdp.Muon on the blocks' matrices (sharded over the two
    ranks, orthogonalised whole), AdamW on the rest, through the seed API."""
    small = ("--steps", "12", "--width", "64", "--depth", "2", "--log-every", "4")
    muon, _ = _losses(tmp_path, "muon", *small, "--optimizer", "muon")
    assert len(muon) == 12
    assert muon[-1] < muon[0] - 0.2, muon
