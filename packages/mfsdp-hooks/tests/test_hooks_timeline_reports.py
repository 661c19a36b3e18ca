"""What a recorded timeline is turned into (2 gloo ranks): the overlap report
(``build_overlap_report``), whose shares must add up to the steps' wall time (a partition,
not estimates), and the Chrome trace (``chrome_trace``), which must be what Perfetto's JSON
importer reads: checked against a schema of the Trace Event Format written here, and for
slices that nest on every lane.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from mfsdp_collectives.testing import run_distributed
from mfsdp_hooks import (
    build_overlap_report,
    chrome_trace,
    fsdp_units,
    record_timeline,
)
from mfsdp_hooks.testing import make_batches, make_model, train_single_process
from mfsdp_hooks.testing.parity import shard_blocks

STEPS = 2
UNITS = ["<root> (ToyModel)", "blocks.0 (Block)", "blocks.1 (Block)"]


def _recorded_worker(rank: int, world: int) -> dict[str, Any]:
    """Two ZeRO-3 steps of a 2-block toy model (a bare AdamW), recorded; what they become."""
    model = make_model(n_blocks=2)
    shard_blocks(model)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    with record_timeline(fsdp_units(model), optimizer) as recorder:
        train_single_process(model, optimizer, make_batches(STEPS, global_batch=4, seed=rank + 1))
    steps, units = list(recorder.steps), recorder.unit_labels()
    report = build_overlap_report(steps, units, rank)
    with pytest.raises(ValueError) as empty:
        build_overlap_report([], units, rank)
    return {
        "units": units,
        "step_ns": sum(step.duration_ns for step in steps),
        "report": report,
        "text": str(report),
        "warm_steps": build_overlap_report(steps[1:], units, rank).steps,
        "empty": str(empty.value),
        "trace": chrome_trace(steps, rank, recorder.origin_ns),
    }


@pytest.fixture(scope="module")
def recorded() -> list[dict[str, Any]]:
    return run_distributed(_recorded_worker, 2, timeout=120)


def test_overlap_report_partitions_the_steps(recorded: list[dict[str, Any]]) -> None:
    for rank, found in enumerate(recorded):
        report = found["report"]
        assert found["units"] == UNITS and [u.unit for u in report.units] == UNITS
        assert (report.rank, report.steps, found["warm_steps"]) == (rank, STEPS, STEPS - 1)
        shares = (
            report.compute_ns,
            report.all_gather_exposed_ns,
            report.reduce_exposed_ns,
            report.optimizer_ns,
            report.other_ns,
        )
        assert sum(shares) == report.step_ns == found["step_ns"]
        assert all(share >= 0 for share in shares)
        assert report.exposed_communication_ns == sum(u.exposed_ns for u in report.units)
        assert report.most_exposed_unit in UNITS
        efficiency = report.overlap_efficiency
        assert efficiency is not None and efficiency <= 1.0
        assert all(unit in found["text"] for unit in UNITS)
        assert "overlap efficiency" in found["text"]
        assert found["empty"].startswith("steps: the timeline holds no complete step")


_COMPLETE = {
    "type": "object",
    "required": ["name", "ph", "ts", "dur", "pid", "tid"],
    "properties": {
        "name": {"type": "string", "minLength": 1},
        "cat": {"type": "string"},
        "ph": {"const": "X"},
        "ts": {"type": "number", "minimum": 0},
        "dur": {"type": "number", "minimum": 0},
        "pid": {"type": "integer", "minimum": 0},
        "tid": {"type": "integer", "minimum": 0},
        "args": {"type": "object"},
    },
}
_METADATA = {
    "type": "object",
    "required": ["name", "ph", "pid", "tid", "args"],
    "properties": {
        "name": {
            "enum": [
                "process_name",
                "process_labels",
                "process_sort_index",
                "thread_name",
                "thread_sort_index",
            ]
        },
        "ph": {"const": "M"},
        "pid": {"type": "integer", "minimum": 0},
        "tid": {"type": "integer", "minimum": 0},
        "args": {
            "type": "object",
            "minProperties": 1,
            "properties": {"name": {"type": "string"}, "sort_index": {"type": "integer"}},
            "additionalProperties": False,
        },
    },
}
TRACE_EVENT_FORMAT = {
    "$schema": "https://json-schema.org/draft/2020-12/schema",
    "type": "object",
    "required": ["traceEvents"],
    "properties": {
        "traceEvents": {"type": "array", "minItems": 1, "items": {"oneOf": [_COMPLETE, _METADATA]}},
        "displayTimeUnit": {"enum": ["ms", "ns"]},
    },
}


def _slices_nest(events: list[dict[str, Any]]) -> bool:
    """On each lane, a slice that starts inside another ends inside it (what a track draws)."""
    lanes: dict[tuple[int, int], list[tuple[int, int]]] = {}
    for e in events:
        start = round(e["ts"] * 1000)
        lanes.setdefault((e["pid"], e["tid"]), []).append((start, start + round(e["dur"] * 1000)))
    for slices in lanes.values():
        open_ends: list[int] = []
        for start, end in sorted(slices, key=lambda s: (s[0], -s[1])):
            while open_ends and open_ends[-1] <= start:
                open_ends.pop()
            if open_ends and end > open_ends[-1]:
                return False
            open_ends.append(end)
    return True


def test_chrome_trace_is_trace_event_format_json(recorded: list[dict[str, Any]]) -> None:
    # The schema check needs jsonschema (the noxfile installs it); a bare machine skips it.
    jsonschema: Any = pytest.importorskip(
        "jsonschema", reason="jsonschema is not installed (nox installs it)"
    )
    for rank, found in enumerate(recorded):
        trace = found["trace"]
        jsonschema.validate(trace, TRACE_EVENT_FORMAT)
        assert trace["displayTimeUnit"] == "ms"
        events = trace["traceEvents"]
        slices = [e for e in events if e["ph"] == "X"]
        assert {e["pid"] for e in events} == {rank}
        lanes = {e["tid"]: e["args"]["name"] for e in events if e["name"] == "thread_name"}
        assert {"steps", "compute", "optimizer", "all-gather"} <= set(lanes.values())
        assert any(name.startswith("reduce-scatter") for name in lanes.values())
        assert {e["tid"] for e in slices} <= set(lanes)
        assert [e["name"] for e in slices if lanes[e["tid"]] == "steps"] == ["step 0", "step 1"]
        names = {e["name"] for e in slices}
        assert {"forward blocks.0 (Block)", "backward <root> (ToyModel)", "optimizer"} <= names
        assert _slices_nest(slices)
