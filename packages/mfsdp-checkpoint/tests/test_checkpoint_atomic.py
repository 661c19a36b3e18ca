"""Atomic saves survive a killed process; bad checkpoints fail clearly, on every rank."""

from __future__ import annotations

import os
import shutil
import signal
from typing import Any

import pytest
import torch
from checkpoint_models import (
    WIDTH,
    ToyModel,
    assert_states_equal,
    make_batches,
    make_model,
    make_optimizer,
    pack,
    shard,
    train,
    unpack,
)
from torch import nn
from torch.distributed.checkpoint.filesystem import FileSystemWriter

import mfsdp_checkpoint as mc
from mfsdp_collectives.testing import DistributedTestError, run_distributed


def _trained(rank: int, world: int, steps: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    model = shard(make_model(), 3)
    optimizer = make_optimizer(model)
    train(model, optimizer, make_batches(steps), rank, world)
    return model, optimizer


def _save_world(rank: int, world: int, path: str) -> bytes:
    model, optimizer = _trained(rank, world, 2)
    mc.save_checkpoint(path, model, optimizer, extra={"step": 2})
    return pack(mc.gather_full_state_dict(model))


def _killed_save_world(rank: int, world: int, path: str, victim: int) -> None:
    """Train further, then start saving to ``path``; rank ``victim`` is SIGKILLed mid-write."""
    model, optimizer = _trained(rank, world, 4)
    if rank == victim:
        original = FileSystemWriter.write_data

        def write_then_die(self: Any, plan: Any, planner: Any) -> Any:
            result = original(self, plan, planner)
            result.wait()  # this rank's data file is on disk; the save is not finished
            os.kill(os.getpid(), signal.SIGKILL)
            return result

        FileSystemWriter.write_data = write_then_die  # type: ignore[method-assign]
    mc.save_checkpoint(path, model, optimizer, extra={"step": 4})


class OtherModel(ToyModel):
    """Another model: one block fewer, a wider value head and a parameter the first lacks."""

    def __init__(self) -> None:
        super().__init__(n_blocks=2)
        self.value = nn.Linear(WIDTH, 2)
        self.scale = nn.Parameter(torch.ones(3))


def _outcome(fn: Any) -> tuple[str, str]:
    try:
        fn()
    except mc.CheckpointError as error:
        return type(error).__name__, str(error)
    return "ok", ""


def _verify_world(rank: int, world: int, paths: dict[str, str]) -> dict[str, Any]:
    model = shard(make_model(seed=3), 3)
    optimizer = make_optimizer(model)
    extra = mc.load_checkpoint(paths["good"], model, optimizer, extra={"step": 0})
    out: dict[str, Any] = {"extra": extra, "full": pack(mc.gather_full_state_dict(model))}
    model_only = {"model": model.state_dict()}
    out["model_only"] = _outcome(lambda: mc.load(model_only, paths["good"]))

    other = shard(OtherModel(), 3)
    other_optimizer = make_optimizer(other)
    cases = ("partial", "unfinished", "missing", "corrupt_data", "truncated", "metadata")
    markers = ("a_file", "marker_unreadable", "marker_foreign", "neither")
    for name in (*cases, "foreign_metadata", *markers):
        out[name] = _outcome(lambda n=name: mc.load_checkpoint(paths[n], model, optimizer))
    out["other_model"] = _outcome(lambda: mc.load_checkpoint(paths["good"], other, other_optimizer))
    return out


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("atomic")
    good, fresh = root / "good", root / "fresh"
    full = unpack(run_distributed(_save_world, 2, str(good), timeout=120)[0])
    # Overwriting a complete checkpoint: a rank dies after writing its file.
    with pytest.raises(DistributedTestError, match="ProcessExit"):
        run_distributed(_killed_save_world, 2, str(good), 1, timeout=120)
    # Saving to a new path: the only rank dies mid-save.
    with pytest.raises(DistributedTestError, match="ProcessExit"):
        run_distributed(_killed_save_world, 1, str(fresh), 0, timeout=120)
    assert (root / "good.partial").is_dir() and (root / "fresh.partial").is_dir()
    assert not fresh.exists()

    damaged = {}
    for name in ("corrupt_data", "truncated", "metadata", "foreign_metadata"):
        damaged[name] = root / name
        shutil.copytree(good, damaged[name])
    data = sorted(damaged["corrupt_data"].glob("*.distcp"))[0]
    blob = bytearray(data.read_bytes())
    blob[len(blob) // 2] ^= 0xFF
    data.write_bytes(bytes(blob))
    victim = sorted(damaged["truncated"].glob("*.distcp"))[-1]
    victim.write_bytes(victim.read_bytes()[:-7])
    for name in ("metadata", "foreign_metadata"):
        metadata = damaged[name] / ".metadata"
        metadata.write_bytes(b"\x80\x04 not a pickle".ljust(metadata.stat().st_size, b"!"))
    (damaged["foreign_metadata"] / "mfsdp_checkpoint.json").unlink()  # a plain DCP directory
    for name in ("marker_unreadable", "marker_foreign", "neither"):
        damaged[name] = root / name
        shutil.copytree(good, damaged[name])
    (damaged["marker_unreadable"] / "mfsdp_checkpoint.json").write_text('{"format": ')
    (damaged["marker_foreign"] / "mfsdp_checkpoint.json").write_text('{"format": "other"}')
    (damaged["neither"] / "mfsdp_checkpoint.json").unlink()
    (damaged["neither"] / ".metadata").unlink()
    damaged["a_file"] = root / "a_file.pt"
    damaged["a_file"].write_bytes(b"not a directory")
    paths = {
        "good": str(good),
        "partial": str(root / "good.partial"),
        "unfinished": str(fresh),
        "missing": str(root / "never_saved"),
        **{k: str(v) for k, v in damaged.items()},
    }
    results = run_distributed(_verify_world, 2, paths, timeout=180)
    return {"full": full, "results": results}


def test_killed_save_leaves_the_previous_checkpoint_loadable(checkpoints: dict[str, Any]) -> None:
    for result in checkpoints["results"]:
        assert result["extra"] == {"step": 2}, "the checkpoint loaded is the one saved before"
        assert result["model_only"] == ("ok", "")
    full = unpack(checkpoints["results"][0]["full"])
    assert_states_equal(full, checkpoints["full"], "weights of the surviving checkpoint")


@pytest.mark.parametrize(
    ("case", "error", "words"),
    [
        ("partial", "IncompleteCheckpointError", ["incomplete", "never finished"]),
        ("unfinished", "CheckpointNotFoundError", ["no checkpoint", "unfinished save"]),
        ("missing", "CheckpointNotFoundError", ["no checkpoint at"]),
        ("corrupt_data", "CorruptCheckpointError", ["corrupted", "CRC32"]),
        ("truncated", "CorruptCheckpointError", ["truncated"]),
        ("metadata", "CorruptCheckpointError", [".metadata", "corrupted"]),
        ("foreign_metadata", "CorruptCheckpointError", [".metadata cannot be read"]),
        ("a_file", "CheckpointNotFoundError", ["is a file, not a DCP checkpoint directory"]),
        ("marker_unreadable", "CorruptCheckpointError", ["mfsdp_checkpoint.json is unreadable"]),
        ("marker_foreign", "CorruptCheckpointError", ["is not an", "completion marker"]),
        ("neither", "IncompleteCheckpointError", ["neither a completion marker", ".metadata"]),
        (
            "other_model",
            "StateDictMismatchError",
            ["module.scale", "module.blocks.2.fc1.weight", "module.value.weight (checkpoint"],
        ),
    ],
)
def test_bad_checkpoints_fail_clearly_on_every_rank(
    checkpoints: dict[str, Any], case: str, error: str, words: list[str]
) -> None:
    outcomes = [result[case] for result in checkpoints["results"]]
    assert all(o == outcomes[0] for o in outcomes), f"ranks disagree: {outcomes}"
    kind, message = outcomes[0]
    assert kind == error, message
    for word in words:
        assert word in message, f"{word!r} not in: {message}"
