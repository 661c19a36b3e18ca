"""The launch-bound benchmark runs end to end (tiny: 2 layers, 1 step, world 1) and reports
each implementation's phases and counts; the figures themselves are in RESULTS.md."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("transformers")

from benchmarks import host_bound


def test_host_bound_reports_every_implementation(tmp_path: Path) -> None:
    out = tmp_path / "host_bound.json"
    argv = ["--world-sizes", "1", "--layers", "2", "--steps", "1", "--warmup", "1"]
    host_bound.main([*argv, "--out", str(out)])
    rows = json.loads(out.read_text())["rows"]
    assert [row["impl"] for row in rows] == list(host_bound.IMPLS)
    for row in rows:
        assert row["step_ms"] > 0 and row["aten_ops"] > 0, row
        assert (row["engine_entries"] > 0) == (row["impl"] != "none"), row
        assert row["peak_rss_mib"] > 0, row
    assert len(host_bound.table(rows).splitlines()) == 2 + len(rows)
