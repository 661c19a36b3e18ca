"""``megatron_fsdp.trace``: the per-unit timeline through every entry point, its report, its
Chrome trace file, and its ranges inside a ``torch.profiler`` trace (2 gloo ranks).

The report's shares must add up to the steps' wall time (a partition, not estimates), the
file must hold the timeline's Chrome trace (whose format ``test_hooks_timeline_reports.py``
checks), and tracing must not change a single loss.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

import megatron_fsdp
from megatron_fsdp import (
    FSDPDistributedIndex,
    MegatronFSDP,
    Timeline,
    fully_shard_model,
    fully_shard_optimizer,
)
from mfsdp_collectives.testing import run_distributed
from mfsdp_hooks import EventKind, fsdp_units, record_timeline
from mfsdp_hooks import fully_shard as fully_shard_module
from mfsdp_hooks.testing import Block, make_batches, make_model, train_single_process

STEPS = 3
ENTRIES = ["fully_shard", "model+optimizer", "MegatronFSDP", "per-module"]


def _build(entry: str) -> tuple[nn.Module, torch.optim.Optimizer]:
    """A 2-block toy model (a root with a frozen layer and tied weights), sharded ZeRO-3."""
    if entry == "fully_shard":
        original = make_model(n_blocks=2)
        return megatron_fsdp.fully_shard(
            original, torch.optim.AdamW(original.parameters(), lr=1e-2), fsdp_unit_modules=[Block]
        )
    model: nn.Module
    if entry == "model+optimizer":
        model = fully_shard_model(make_model(n_blocks=2), fsdp_unit_modules=[Block])
    elif entry == "MegatronFSDP":
        mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp_shard",))
        index = FSDPDistributedIndex(mesh, dp_shard_dim="dp_shard")
        model = MegatronFSDP(make_model(n_blocks=2), index, fsdp_unit_modules=[Block])
    else:
        toy = make_model(n_blocks=2)
        for block in toy.blocks:
            fully_shard_module(block)
        fully_shard_module(toy)
        trainable = [p for p in toy.parameters() if p.requires_grad]
        return toy, torch.optim.AdamW(trainable, lr=1e-2)  # a bare torch optimizer
    return model, fully_shard_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-2))


def _train(
    model: nn.Module, optimizer: torch.optim.Optimizer, rank: int, steps: int
) -> list[float]:
    """``steps`` plain steps on this rank's own batches (a seed per rank)."""
    batches = make_batches(steps, global_batch=4, seed=rank + 1)
    return train_single_process(model, optimizer, batches)


def _check_steps(timeline: Timeline) -> dict[str, Any]:
    units = timeline.units
    for step in timeline.steps:
        assert sum(step.host_time().values()) == step.duration_ns
        for unit in units:
            assert len(step.of_kind(EventKind.FORWARD, unit)) == 1, (unit, step.index)
            assert len(step.of_kind(EventKind.BACKWARD, unit)) == 1, (unit, step.index)
            assert len(step.of_kind(EventKind.REDUCE, unit)) == 1, (unit, step.index)
            for gather in step.of_kind(EventKind.ALL_GATHER, unit):
                issues = step.of_kind(EventKind.ALL_GATHER_ISSUE, unit)
                assert gather.start_ns in {issue.start_ns for issue in issues}
                assert gather.start_ns < gather.end_ns
        (optimizer,) = step.of_kind(EventKind.OPTIMIZER)
        assert optimizer.end_ns == step.end_ns  # the step ends with the optimizer's
    report = timeline.overlap_report()
    shares = (
        report.compute_ns,
        report.all_gather_exposed_ns,
        report.reduce_exposed_ns,
        report.optimizer_ns,
        report.other_ns,
    )
    assert sum(shares) == report.step_ns == sum(s.duration_ns for s in timeline.steps)
    assert all(share >= 0 for share in shares)
    assert report.most_exposed_unit in units
    efficiency = report.overlap_efficiency
    assert efficiency is not None and efficiency <= 1.0
    text = str(report)
    assert all(unit in text for unit in units) and "overlap efficiency" in text
    return {
        "units": units,
        "gathers": [len(s.of_kind(EventKind.ALL_GATHER)) for s in timeline.steps],
        "warm_report_steps": timeline.overlap_report(warmup_steps=1).steps,
    }


def _entry_worker(rank: int, world: int, entry: str) -> dict[str, Any]:
    untraced = _train(*_build(entry), rank, STEPS)
    model, optimizer = _build(entry)
    with megatron_fsdp.trace(model, optimizer) as timeline:
        losses = _train(model, optimizer, rank, STEPS)
    recorded = timeline.steps
    _train(model, optimizer, rank, 1)  # after the block: nothing more is recorded
    found = _check_steps(timeline)
    found["same_losses"] = losses == untraced
    found["steps"] = len(recorded)
    found["nothing_after"] = timeline.steps == recorded
    found["hooks_left"] = len(optimizer._optimizer_step_pre_hooks) + len(
        optimizer._optimizer_step_post_hooks
    )
    return found


@pytest.mark.parametrize("entry", ENTRIES)
def test_trace_through_every_entry_point(entry: str) -> None:
    for found in run_distributed(_entry_worker, 2, entry, timeout=120):
        assert found["same_losses"]
        assert found["steps"] == STEPS and found["nothing_after"]
        assert found["hooks_left"] == 0
        assert found["units"] == ["<root> (ToyModel)", "blocks.0 (Block)", "blocks.1 (Block)"]
        # ZeRO-3: each unit gathers for forward, the blocks again for backward.
        assert found["gathers"] == [5] * STEPS
        assert found["warm_report_steps"] == STEPS - 1


# ----------------------------------------------------------------- the Chrome trace file
# (its format is mfsdp_hooks.chrome_trace's, checked in test_hooks_timeline_reports.py)


def _save_worker(rank: int, world: int, directory: str) -> tuple[str, bool]:
    model, optimizer = _build("fully_shard")
    with megatron_fsdp.trace(model, optimizer) as timeline:
        _train(model, optimizer, rank, 2)
    path = timeline.save(os.path.join(directory, f"rank{rank}.json"))
    with open(path) as f:
        return str(path), json.load(f) == timeline.chrome_trace()


def test_save_writes_each_ranks_chrome_trace_whole(tmp_path: Any) -> None:
    results = run_distributed(_save_worker, 2, str(tmp_path), timeout=120)
    assert sorted(os.listdir(tmp_path)) == ["rank0.json", "rank1.json"]  # no temporaries
    for rank, (path, same) in enumerate(results):
        assert path == str(tmp_path / f"rank{rank}.json") and same
        with open(path) as f:
            trace = json.load(f)
        assert {e["pid"] for e in trace["traceEvents"]} == {rank}
        steps = [e["name"] for e in trace["traceEvents"] if e["name"].startswith("step ")]
        assert steps == ["step 0", "step 1"]


# ----------------------------------------------------------------- torch.profiler


def _profiler_worker(rank: int, world: int) -> tuple[list[str], list[str], int]:
    model, optimizer = _build("fully_shard")
    _train(model, optimizer, rank, 1)
    with megatron_fsdp.trace(model, optimizer), torch.profiler.profile() as profile:
        _train(model, optimizer, rank, 1)
    ranged = sorted({e.name for e in profile.events() if e.name.startswith("mfsdp:")})
    # A planning run records segments without profiler ranges (each one is a dispatched op).
    quiet = record_timeline(fsdp_units(model), optimizer, profiler_ranges=False)
    with quiet as recorder, torch.profiler.profile() as profile:
        _train(model, optimizer, rank, 1)
    unranged = sorted({e.name for e in profile.events() if e.name.startswith("mfsdp:")})
    return ranged, unranged, len(recorder.steps)


def test_profiler_trace_holds_the_timeline_ranges() -> None:
    for names, unranged, steps in run_distributed(_profiler_worker, 2, timeout=120):
        assert unranged == [] and steps == 1, (unranged, steps)
        for wanted in (
            "mfsdp:forward blocks.0 (Block)",
            "mfsdp:backward blocks.1 (Block)",
            "mfsdp:all_gather_wait blocks.1 (Block)",
            "mfsdp:reduce_issue <root> (ToyModel)",
            "mfsdp:optimizer",
        ):
            assert wanted in names, (wanted, names)


# ----------------------------------------------------------------- refusals


def _refusals_worker(rank: int, world: int) -> list[str]:
    model, optimizer = _build("per-module")
    other, other_optimizer = _build("per-module")
    _train(model, optimizer, rank, 1)  # the root exists: a block alone is refused
    cases: list[tuple[type[Exception], Callable[[], object]]] = [
        (ValueError, lambda: megatron_fsdp.trace(nn.Linear(2, 2)).__enter__()),
        (TypeError, lambda: megatron_fsdp.trace("model").__enter__()),  # type: ignore[arg-type]
        (TypeError, lambda: megatron_fsdp.trace(model, "adam").__enter__()),  # type: ignore[arg-type]
        (ValueError, lambda: megatron_fsdp.trace(model, other_optimizer).__enter__()),
        (ValueError, lambda: megatron_fsdp.trace(model.get_submodule("blocks.0")).__enter__()),
    ]
    messages = []
    for error, call in cases:
        with pytest.raises(error) as raised:
            call()
        messages.append(str(raised.value))
    with megatron_fsdp.trace(model) as timeline:
        with pytest.raises(RuntimeError) as nested, megatron_fsdp.trace(model):
            pass
        messages.append(str(nested.value))
    with pytest.raises(ValueError) as empty:
        timeline.overlap_report()
    messages.append(str(empty.value))
    del other
    return messages


def test_what_cannot_be_traced_is_refused_naming_the_argument() -> None:
    for messages in run_distributed(_refusals_worker, 2, timeout=120):
        no_units, not_module, not_optimizer, foreign, part, nested, empty = messages
        assert no_units.startswith("model: Linear has no FSDP units")
        assert "nn.Module" in not_module
        assert not_optimizer.startswith("optimizer must be a torch.optim.Optimizer")
        assert foreign.startswith("optimizer steps none of the traced model's")
        assert part.startswith("model: FSDPBlock is inside a larger FSDP model")
        assert "one at a time" in nested
        assert empty.startswith("steps: the timeline holds no complete step")
