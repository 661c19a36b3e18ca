"""The plan-against-measurement benchmark runs end to end on a CPU (a tiny Llama, world 1):
the plan is within 3% of the measured peak and bytes between steps; the GPU rows come from
``scripts/gpu_check.py``."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

pytest.importorskip("transformers")
if os.environ.get("MFSDP_FULL_MATRIX") != "1":  # CI: tests/test_megatron_fsdp_plan*.py
    pytest.skip("MFSDP_FULL_MATRIX=1 (nox -s tests_full) runs it", allow_module_level=True)

from benchmarks import plan_vs_measured


def test_the_plan_of_a_tiny_llama_is_its_measured_memory(tmp_path: Path) -> None:
    out = tmp_path / "plan.json"
    plan_vs_measured.main(["--device", "cpu", "--models", "tiny", "--out", str(out)])
    (row,) = json.loads(out.read_text())
    planned, measured = row["planned"], row["measured"]
    assert abs(planned["peak"] / measured["peak"] - 1) <= 0.03, row
    assert abs(planned["between"] / measured["between"] - 1) <= 0.03, row
    assert planned["phase"].startswith(("forward of", "backward of", "optimizer"))
    assert len(plan_vs_measured.table([row]).splitlines()) == 3
