"""examples/finetune_hf.py end to end: 2 CPU ranks under torchrun, a rank killed mid-run,
the same command run again resuming from the newest checkpoint, and the export read by
from_pretrained."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import torch
from example_runs import run_example

from mfsdp_checkpoint import convert

transformers = pytest.importorskip("transformers")


def _run_example(work: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return run_example("finetune_hf.py", "--work-dir", str(work), *args)


def test_finetune_survives_a_killed_rank_and_exports_for_from_pretrained(tmp_path: Path) -> None:
    work = tmp_path / "work"
    args = ("--steps", "6", "--save-every", "3", "--simulate-crash-at", "4")
    crashed = _run_example(work, *args)
    assert crashed.returncode != 0, crashed.stdout[-4000:]
    assert (work / "crash_simulated").exists(), crashed.stdout[-4000:] + crashed.stderr[-4000:]
    done = _run_example(work, *args)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    assert "resumed from" in done.stdout and "step_3 at step 3" in done.stdout, done.stdout

    records = [json.loads(line) for line in (work / "losses.jsonl").read_text().splitlines()]
    steps = [r["step"] for r in records]
    # Steps 1-4 ran, rank 1 died; the second run resumed from step_3 and ran 4-6 again.
    assert steps == [1, 2, 3, 4, 4, 5, 6], steps
    before_crash, after_resume = records[3]["loss"], records[4]["loss"]
    assert abs(before_crash - after_resume) <= 1e-5 * abs(before_crash), records
    assert records[-1]["loss"] < records[0]["loss"], records

    export = work / "export"
    assert (export / "config.json").exists() and (export / "model.safetensors").exists()
    assert "max |logit difference| 0.00e+00" in done.stdout, done.stdout[-2000:]
    loaded = transformers.LlamaForCausalLM.from_pretrained(export)
    # The export holds the weights of the final checkpoint, read here with torch's DCP reader.
    final = work / "checkpoints" / "step_6"
    flat = tmp_path / "final.pt"
    convert(final, flat, "torch", select="model", strip_prefixes=["module."])
    saved = torch.load(flat, weights_only=True)
    exported = loaded.state_dict()
    assert set(saved) == set(exported)
    for name, value in saved.items():
        assert torch.equal(value, exported[name]), name
