"""The ``mfsdp-checkpoint`` command line: conversions that keep every bit, and ``inspect``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
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
from safetensors.torch import load_file

import mfsdp_checkpoint as mc
from mfsdp_checkpoint.cli import main
from mfsdp_checkpoint.sources import open_reader
from mfsdp_collectives.testing import run_distributed


def _save_world(rank: int, world: int, path: str) -> bytes:
    model = shard(make_model(), 3)
    optimizer = make_optimizer(model)
    train(model, optimizer, make_batches(2), rank, world)
    extra = {
        "bf16": torch.arange(6, dtype=torch.bfloat16).reshape(2, 3) / 7,
        "flags": torch.tensor([True, False]),
        "rng": torch.get_rng_state(),
        "iteration": 2,
    }
    mc.save_checkpoint(path, model, optimizer, extra=extra)
    return pack(mc.gather_full_state_dict(model))


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, torch.Tensor]]:
    """A DCP checkpoint of a sharded model + AdamW (2 ranks) with bf16, bool and int extras."""
    path = tmp_path_factory.mktemp("cli") / "ckpt"
    full = unpack(run_distributed(_save_world, 2, str(path), timeout=120)[0])
    return path, full


def _everything(path: Path) -> dict[str, Any]:
    reader = open_reader(path)
    values: dict[str, Any] = {}
    for entry in reader.entries:
        values[entry.key] = (
            (entry.path, reader.tensor(entry.key).clone())
            if entry.is_tensor
            else (entry.path, reader.object(entry.key))
        )
    return values


def _bits(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.reshape(-1).view(torch.uint8)


def _assert_bit_identical(got: dict[str, Any], want: dict[str, Any]) -> None:
    assert sorted(got) == sorted(want)
    for key, (path, value) in want.items():
        other_path, other = got[key]
        assert other_path == path, f"{key}: nesting {other_path} != {path}"
        if isinstance(value, torch.Tensor):
            assert other.dtype == value.dtype and other.shape == value.shape, key
            assert torch.equal(_bits(other), _bits(value)), key
        else:
            assert other == value, key


@pytest.mark.parametrize("middle", ["safetensors", "torch"])
def test_round_trip_through_a_single_file_keeps_every_bit(
    checkpoint: tuple[Path, Any], tmp_path: Path, middle: str
) -> None:
    path, _ = checkpoint
    single = tmp_path / ("ckpt.safetensors" if middle == "safetensors" else "ckpt.pt")
    back = tmp_path / "back"
    assert main(["convert", str(path), str(single), "--to", middle]) == 0
    assert main(["convert", str(single), str(back), "--to", "dcp"]) == 0
    original = _everything(path)
    _assert_bit_identical(_everything(back), original)
    assert "optimizer.param_groups.0.betas" in original and "extra.iteration" in original
    if middle == "safetensors":
        official = load_file(single)  # the safetensors library reads what we stream out
        assert torch.equal(official["extra.rng"], original["extra.rng"][1])


def test_hugging_face_names_load_into_a_plain_model(
    checkpoint: tuple[Path, dict[str, torch.Tensor]], tmp_path: Path
) -> None:
    path, full = checkpoint
    out = tmp_path / "model.safetensors"
    args = ["convert", str(path), str(out), "--to", "safetensors", "--select", "model"]
    assert main([*args, "--hf-prefix-strip", "module."]) == 0
    plain = make_model(seed=5)
    plain.load_state_dict(load_file(out), strict=True)
    expected = {k.removeprefix("module."): v for k, v in full.items()}
    assert_states_equal(dict(plain.state_dict()), expected, "plain model from the export")


def test_from_pretrained_reads_the_export(tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(n_layer=2, n_embd=16, n_head=2, vocab_size=50, n_positions=8)
    original = transformers.GPT2LMHeadModel(config)
    state = {f"module.{k}": v.detach().clone() for k, v in original.state_dict().items()}
    mc.save({"model": state}, tmp_path / "dcp")
    export = tmp_path / "hf"
    export.mkdir()
    config.save_pretrained(export)
    args = ["convert", str(tmp_path / "dcp"), str(export / "model.safetensors"), "--to"]
    assert main([*args, "safetensors", "--select", "model", "--strip-prefix", "module."]) == 0
    loaded = transformers.GPT2LMHeadModel.from_pretrained(export)
    for key, value in original.state_dict().items():
        assert torch.equal(loaded.state_dict()[key], value), key


def test_inspect_reports_keys_shapes_bytes_and_world_size(
    checkpoint: tuple[Path, Any], capsys: pytest.CaptureFixture[str]
) -> None:
    path, _ = checkpoint
    assert main(["inspect", str(path), "--json", "--verify"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["format"] == "dcp" and report["world_size"] == 2 and report["verified"]
    tensors = {t["key"]: t for t in report["tensors"]}
    assert tensors["model.module.embed.weight"]["shape"] == [11, 15]
    assert tensors["model.module.embed.weight"]["dtype"] == "float32"
    assert tensors["extra.bf16"]["dtype"] == "bfloat16"
    assert report["total_bytes"] == sum(t["bytes"] for t in report["tensors"])
    assert "optimizer.param_groups.0.params" in report["objects"]
    assert main(["inspect", str(path)]) == 0
    text = capsys.readouterr().out
    assert "world size:  2" in text and "model.module.blocks.2.fc2.weight" in text


def test_command_line_entry_point_and_errors(checkpoint: tuple[Path, Any], tmp_path: Path) -> None:
    path, _ = checkpoint
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    run = [sys.executable, "-m", "mfsdp_checkpoint"]
    ok = subprocess.run([*run, "inspect", str(path)], capture_output=True, text=True, env=env)
    assert ok.returncode == 0, ok.stderr
    missing = subprocess.run(
        [*run, "inspect", str(tmp_path / "nope")], capture_output=True, text=True, env=env
    )
    assert missing.returncode == 1 and "no checkpoint at" in missing.stderr
    (tmp_path / "half.partial").mkdir()
    (tmp_path / "half.partial" / ".mfsdp_save_in_progress").write_text("{}")
    assert main(["inspect", str(tmp_path / "half.partial")]) == 1


def test_unreadable_files_and_bad_arguments_are_named(
    checkpoint: tuple[Path, Any], tmp_path: Path
) -> None:
    path, _ = checkpoint
    with pytest.raises(ValueError, match=r"^to must be one of \('dcp', 'torch', 'safetensors'"):
        mc.convert(path, tmp_path / "out", to="onnx")  # type: ignore[arg-type]
    with pytest.raises(mc.CheckpointError, match=r"select='weights' matches nothing; the sections"):
        mc.convert(path, tmp_path / "out.safetensors", to="safetensors", select="weights")
    (tmp_path / "garbage.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{not json")
    with pytest.raises(mc.CorruptCheckpointError, match="is not a valid safetensors file"):
        mc.describe(tmp_path / "garbage.safetensors")
    (tmp_path / "garbage.pt").write_bytes(b"PK\x03\x04 not a zip archive")
    with pytest.raises(mc.CorruptCheckpointError, match=r"garbage\.pt cannot be read"):
        mc.describe(tmp_path / "garbage.pt")
    torch.save([1, 2], tmp_path / "list.pt")
    with pytest.raises(mc.CorruptCheckpointError, match=r"list\.pt holds a list, not a dict"):
        mc.describe(tmp_path / "list.pt")
