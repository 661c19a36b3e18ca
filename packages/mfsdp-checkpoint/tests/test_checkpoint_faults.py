"""Crashes at every step of a save, flipped bytes, and saves that run while training goes on.

* Kill points: a save is SIGKILLed at 27 points (inside data and metadata writes at several byte
  offsets, between files, while checksumming, around the marker, at each step of the rename
  that publishes it, while clearing an old staging directory). Afterwards ``path`` loads as
  the previous checkpoint exactly (or as the new one, once the commit rename happened, or not at
  all when there was none), and the staging directory is always refused as incomplete.
* Corruption: one flipped byte anywhere in a data file or the DCP metadata is reported as
  ``CorruptCheckpointError`` naming that file, on every rank.
* Async save: see ``test_checkpoint_async.py``.
"""

from __future__ import annotations

import shutil
import warnings
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import torch
from checkpoint_models import (
    assert_states_equal,
    make_batches,
    make_model,
    make_optimizer,
    pack,
    shard,
    train,
    unpack,
)
from fault_injection import Trigger, arm
from torch import nn

import mfsdp_checkpoint as mc
from mfsdp_checkpoint.marker import IN_PROGRESS, MARKER, write_in_progress
from mfsdp_collectives.testing import DistributedTestError, run_distributed

OLD_STEPS, NEW_STEPS = 2, 3
_ATOMIC = "mfsdp_checkpoint.atomic"
_DCP_FS = "torch.distributed.checkpoint.filesystem"
_TIMEOUT = 60

# name: (world size, victim rank, what is at the path before, trigger, what loads afterwards)
KILL_POINTS: dict[str, tuple[int, int, str, Trigger, str]] = {
    "staging_dir_created": (1, 0, "old", ("call", "before", _ATOMIC, "write_in_progress"), "old"),
    "sentinel_written": (1, 0, "old", ("call", "after", _ATOMIC, "write_in_progress"), "old"),
    "data_byte_0": (1, 0, "old", ("bytes", ".distcp", 0), "old"),
    "data_byte_1": (1, 0, "old", ("bytes", ".distcp", 1), "old"),
    "data_byte_100": (1, 0, "old", ("bytes", ".distcp", 100), "old"),
    "data_byte_4096": (1, 0, "old", ("bytes", ".distcp", 4096), "old"),
    "data_half": (1, 0, "old", ("bytes", ".distcp", 0.5), "old"),
    "data_all_but_last_byte": (1, 0, "old", ("bytes", ".distcp", -1), "old"),
    "data_file_closed": (1, 0, "old", ("closed", ".distcp"), "old"),
    "metadata_byte_0": (1, 0, "old", ("bytes", ".metadata.tmp", 0), "old"),
    "metadata_byte_64": (1, 0, "old", ("bytes", ".metadata.tmp", 64), "old"),
    "metadata_closed": (1, 0, "old", ("closed", ".metadata.tmp"), "old"),
    "dcp_finished": (1, 0, "old", ("call", "after", _DCP_FS, "FileSystemWriter.finish"), "old"),
    "checksumming": (1, 0, "old", ("call", "before", _ATOMIC, "crc32_of"), "old"),
    "marker_tmp_written": (1, 0, "old", ("path", "replace", f"{MARKER}.tmp", "before"), "old"),
    "marker_placed": (1, 0, "old", ("path", "unlink", IN_PROGRESS, "before"), "old"),
    "before_publish": (1, 0, "old", ("call", "before", _ATOMIC, "_publish"), "old"),
    "old_moved_aside": (1, 0, "old", ("path", "rename", "<target>", "after"), "old"),
    "new_renamed_in": (1, 0, "old", ("path", "rename", "<staging>", "after"), "new"),
    "deleting_old": (1, 0, "old", ("rmtree", ".old"), "new"),
    "clearing_stale_staging": (1, 0, "stale", ("rmtree", ".partial"), "old"),
    "fresh_data_half": (1, 0, "none", ("bytes", ".distcp", 0.5), "none"),
    "fresh_before_publish": (1, 0, "none", ("call", "before", _ATOMIC, "_publish"), "none"),
    "fresh_renamed_in": (1, 0, "none", ("path", "rename", "<staging>", "after"), "new"),
    "2ranks_rank1_data_byte_1000": (2, 1, "old", ("bytes", ".distcp", 1000), "old"),
    "2ranks_rank1_checksumming": (2, 1, "old", ("call", "before", _ATOMIC, "crc32_of"), "old"),
    "2ranks_rank0_before_publish": (2, 0, "old", ("call", "before", _ATOMIC, "_publish"), "old"),
}


def _trained(rank: int, world: int, steps: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    model = shard(make_model(), 3)
    optimizer = make_optimizer(model)
    train(model, optimizer, make_batches(steps), rank, world)
    return model, optimizer


def _reference_world(rank: int, world: int, path: str) -> dict[str, bytes]:
    """Save the "old" checkpoint; return it and the "new" state the killed saves write."""
    model, optimizer = _trained(rank, world, OLD_STEPS)
    mc.save_checkpoint(path, model, optimizer, extra={"step": OLD_STEPS})
    old = pack(mc.gather_full_state_dict(model))
    model, optimizer = _trained(rank, world, NEW_STEPS)
    return {"old": old, "new": pack(mc.gather_full_state_dict(model))}


def _killed_world(rank: int, world: int, path: str, victim: int, trigger: Trigger) -> None:
    model, optimizer = _trained(rank, world, NEW_STEPS)
    if rank == victim:
        arm(trigger, path)
    mc.save_checkpoint(path, model, optimizer, extra={"step": NEW_STEPS})
    if rank == victim:
        raise AssertionError(f"kill point {trigger} was never reached")


def _outcome(fn: Any) -> tuple[str, str]:
    try:
        fn()
    except mc.CheckpointError as error:
        return type(error).__name__, str(error)
    return "ok", ""


def _verify(model: nn.Module, optimizer: torch.optim.Optimizer, path: str) -> dict[str, Any]:
    extra: dict[str, Any] = {}

    def load() -> None:
        extra.update(mc.load_checkpoint(path, model, optimizer, extra={"step": -1}))

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        outcome = _outcome(load)
    return {
        "load": outcome,
        "extra": extra,
        "full": pack(mc.gather_full_state_dict(model)) if outcome[0] == "ok" else None,
        "warnings": [str(w.message) for w in caught if "killed" in str(w.message)],
        "partial": _outcome(lambda: mc.load_checkpoint(path + ".partial", model)),
    }


def _verify_world(rank: int, world: int, paths: dict[str, str]) -> dict[str, Any]:
    """Load every case (and its staging directory) into one fresh model."""
    model = shard(make_model(seed=7), 3)
    optimizer = make_optimizer(model)
    return {name: _verify(model, optimizer, path) for name, path in paths.items()}


def _budget(trigger: Trigger, size: int) -> Trigger:
    """Byte budgets given as a fraction (or as bytes short of the end) of the file's size."""
    if trigger[0] != "bytes" or (isinstance(trigger[2], int) and trigger[2] >= 0):
        return trigger
    budget = int(size * trigger[2]) if isinstance(trigger[2], float) else size + trigger[2]
    assert 0 < budget < size
    return (*trigger[:2], budget)


def _stale_staging(source: Path, staging: Path) -> None:
    """What an earlier save killed mid-way leaves: all files, a sentinel, no marker."""
    shutil.copytree(source, staging)
    (staging / MARKER).unlink()
    write_in_progress(staging)


def _kill(name: str, path: Path, data_bytes: int) -> str:
    """Run the save of kill point ``name`` to ``path``; '' if it died where it should."""
    world, victim, _, trigger, _ = KILL_POINTS[name]
    try:
        armed = _budget(trigger, data_bytes)
        run_distributed(_killed_world, world, str(path), victim, armed, timeout=_TIMEOUT)
    except DistributedTestError as error:
        if (error.exc_type, error.rank) == ("ProcessExit", victim):
            return ""
        return f"{name}: the save did not die at its kill point: {error}"
    return f"{name}: the save finished"


@pytest.fixture(scope="module")
def kills(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("kills")
    old_dir = root / "reference"
    states = run_distributed(_reference_world, 1, str(old_dir), timeout=_TIMEOUT)[0]
    (data_file,) = old_dir.glob("*.distcp")
    paths = {name: root / name for name in KILL_POINTS}
    for name, (_, _, before, _, _) in KILL_POINTS.items():
        if before in ("old", "stale"):
            shutil.copytree(old_dir, paths[name])
        if before == "stale":
            _stale_staging(old_dir, root / f"{name}.partial")
    # Two worlds at a time: each spends most of its second starting up on one core.
    with ThreadPoolExecutor(max_workers=2) as pool:
        size = data_file.stat().st_size
        failures = [f for f in pool.map(lambda n: _kill(n, paths[n], size), paths) if f]
    assert not failures, "\n".join(failures)
    as_text = {name: str(path) for name, path in paths.items()}
    results = run_distributed(_verify_world, 1, as_text, timeout=_TIMEOUT)[0]
    return {"root": root, "states": states, "results": results}


@pytest.mark.parametrize("point", sorted(KILL_POINTS))
def test_killed_save_never_loads_as_complete(kills: dict[str, Any], point: str) -> None:
    expect = KILL_POINTS[point][4]
    result = kills["results"][point]
    kind, message = result["load"]
    if expect == "none":
        assert kind == "CheckpointNotFoundError", message
        assert "unfinished save" in message, message
    else:
        assert kind == "ok", f"{point}: {message}"
        assert result["extra"] == {"step": OLD_STEPS if expect == "old" else NEW_STEPS}
        want = unpack(kills["states"][expect])
        assert_states_equal(unpack(result["full"]), want, f"{point}: {expect} checkpoint")
    staging = kills["root"] / f"{point}.partial"
    partial_kind, partial_message = result["partial"]
    if expect == "new":
        assert not staging.exists(), f"{point}: the staging directory outlived the commit"
        assert partial_kind == "CheckpointNotFoundError", partial_message
    else:
        assert staging.is_dir(), f"{point}: the kill left no staging directory"
        assert partial_kind == "IncompleteCheckpointError", partial_message
        assert "never finished" in partial_message, partial_message
    interrupted_swap = point == "old_moved_aside"
    assert bool(result["warnings"]) == interrupted_swap, result["warnings"]


def _resave_world(rank: int, world: int, path: str) -> tuple[bytes, dict[str, Any]]:
    model, optimizer = _trained(rank, world, NEW_STEPS)
    mc.save_checkpoint(path, model, optimizer, extra={"step": NEW_STEPS})
    fresh = shard(make_model(seed=7), 3)
    extra = mc.load_checkpoint(path, fresh, make_optimizer(fresh), extra={"step": -1})
    return pack(mc.gather_full_state_dict(fresh)), extra


@pytest.mark.parametrize("point", ["old_moved_aside", "deleting_old", "clearing_stale_staging"])
def test_next_save_clears_what_a_kill_left(kills: dict[str, Any], point: str) -> None:
    path = kills["root"] / point
    full, extra = run_distributed(_resave_world, 1, str(path), timeout=_TIMEOUT)[0]
    assert extra == {"step": NEW_STEPS}
    assert_states_equal(unpack(full), unpack(kills["states"]["new"]), point)
    leftovers = sorted(p.name for p in path.parent.glob(f"{point}.*"))
    assert leftovers == [], f"{point}: left behind {leftovers}"


def test_save_refuses_names_it_reserves(tmp_path: Path) -> None:
    for name in ("step_5.partial", "step_5.old"):
        with pytest.raises(ValueError, match=r"path: .* choose a name without"):
            mc.save({"x": torch.zeros(2)}, tmp_path / name)
        assert not (tmp_path / f"{name}.partial").exists()


# --- one flipped byte --------------------------------------------------------------------------

FLIPS = [
    ("__0_0.distcp", "start"),
    ("__0_0.distcp", "middle"),
    ("__1_0.distcp", "middle"),
    ("__1_0.distcp", "end"),
    (".metadata", "start"),
    (".metadata", "middle"),
    (".metadata", "end"),
]


def _save_world(rank: int, world: int, path: str) -> None:
    model, optimizer = _trained(rank, world, OLD_STEPS)
    mc.save_checkpoint(path, model, optimizer, extra={"step": OLD_STEPS})


def _load_all_world(rank: int, world: int, paths: list[str]) -> list[tuple[str, str]]:
    model = shard(make_model(seed=7), 3)
    optimizer = make_optimizer(model)
    return [_outcome(lambda p=p: mc.load_checkpoint(p, model, optimizer)) for p in paths]


@pytest.fixture(scope="module")
def flipped(tmp_path_factory: pytest.TempPathFactory) -> list[list[tuple[str, str]]]:
    root = tmp_path_factory.mktemp("flips")
    good = root / "good"
    run_distributed(_save_world, 2, str(good), timeout=_TIMEOUT)
    paths = [str(good)]
    for number, (name, where) in enumerate(FLIPS):
        damaged = root / f"flip{number}"
        shutil.copytree(good, damaged)
        blob = bytearray((damaged / name).read_bytes())
        at = {"start": 0, "middle": len(blob) // 2, "end": len(blob) - 1}[where]
        blob[at] ^= 0x01
        (damaged / name).write_bytes(bytes(blob))
        paths.append(str(damaged))
    return run_distributed(_load_all_world, 2, paths, timeout=_TIMEOUT)


def test_undamaged_copy_loads(flipped: list[list[tuple[str, str]]]) -> None:
    assert [outcomes[0] for outcomes in flipped] == [("ok", "")] * 2


@pytest.mark.parametrize(("number", "flip"), list(enumerate(FLIPS)))
def test_flipped_byte_is_reported_naming_the_file(
    flipped: list[list[tuple[str, str]]], number: int, flip: tuple[str, str]
) -> None:
    outcomes = [per_rank[number + 1] for per_rank in flipped]
    assert outcomes[0] == outcomes[1], f"ranks disagree: {outcomes}"
    kind, message = outcomes[0]
    assert kind == "CorruptCheckpointError", message
    assert f"file {flip[0]} is corrupted" in message, message
    others = {name for name, _ in FLIPS} - {flip[0]}
    assert not any(other in message for other in others), f"blames another file: {message}"
