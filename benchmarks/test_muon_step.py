"""The Muon benchmark runs end to end (tiny: 1 layer, 1 step, worlds 1 and 2) and its byte
count is the ideal; the figures themselves are in RESULTS.md."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("transformers")

from benchmarks import muon_step


def test_muon_benchmark_reports_bytes_at_the_ideal(tmp_path: Path) -> None:
    out = tmp_path / "muon_step.json"
    argv = ["--world-sizes", "1", "2", "--hidden", "32", "--layers", "1", "--steps", "1"]
    muon_step.main([*argv, "--warmup", "1", "--out", str(out)])
    rows = {(r["world"], r["optimizer"]): r for r in json.loads(out.read_text())["rows"]}
    assert set(rows) == {(1, "one_process"), (1, "muon"), (1, "adamw"), (2, "muon"), (2, "adamw")}
    assert all(row["step_ms"] > 0 for row in rows.values())
    assert rows[(1, "muon")]["bytes"] == 0 and rows[(2, "adamw")]["bytes"] == 0
    sharded = rows[(2, "muon")]
    assert 0 < sharded["bytes"] == sharded["ideal_bytes"] < sharded["whole_bytes"]
    assert len(muon_step.table(list(rows.values())).splitlines()) == 2 + len(rows)
