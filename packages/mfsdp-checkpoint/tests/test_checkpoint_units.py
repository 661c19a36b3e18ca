"""Single-process pieces: the streaming safetensors writer, atomic save/load without a process
group, mismatch reports and input checks."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from checkpoint_models import make_model
from safetensors.torch import load_file, save_file

import mfsdp_checkpoint as mc
from mfsdp_checkpoint.safetensors_io import SafetensorsFile, TensorSpec, write_safetensors

TENSORS = {
    "f32": torch.randn(3, 5),
    "bf16": torch.randn(4, 2).to(torch.bfloat16),
    "f16": torch.randn(7).half(),
    "i64": torch.arange(6).reshape(2, 3),
    "u8": torch.arange(5, dtype=torch.uint8),
    "flags": torch.tensor([True, False, True]),
    "scalar": torch.tensor(2.5),
    "empty": torch.zeros(0, 4),
    "strided": torch.randn(4, 6)[:, ::2],
}


def test_streamed_safetensors_match_the_library_both_ways(tmp_path: Path) -> None:
    ours = tmp_path / "ours.safetensors"
    specs = [TensorSpec(k, tuple(v.shape), v.dtype) for k, v in TENSORS.items()]
    write_safetensors(ours, specs, iter(TENSORS.values()), {"format": "pt", "note": "x"})
    for key, value in load_file(ours).items():
        assert torch.equal(value, TENSORS[key]), key
    theirs = tmp_path / "theirs.safetensors"
    save_file({k: v.contiguous() for k, v in TENSORS.items()}, theirs, metadata={"a": "b"})
    mapped = SafetensorsFile(theirs)
    assert mapped.metadata == {"a": "b"}
    for key, value in TENSORS.items():
        assert torch.equal(mapped.tensor(key), value), key
    assert SafetensorsFile(ours).metadata["note"] == "x"


def test_streamed_safetensors_refuse_a_tensor_that_breaks_the_header(tmp_path: Path) -> None:
    spec = TensorSpec("x", (2, 2), torch.float32)
    with pytest.raises(ValueError, match="header says"):
        write_safetensors(tmp_path / "bad.safetensors", [spec], iter([torch.zeros(3)]))
    assert not (tmp_path / "bad.safetensors").exists()


def test_save_and_load_without_a_process_group(tmp_path: Path) -> None:
    state = {"model": {k: v.clone() for k, v in make_model().state_dict().items()}, "n": 3}
    path = mc.save(state, tmp_path / "ckpt")
    assert (path / "mfsdp_checkpoint.json").exists() and not (tmp_path / "ckpt.partial").exists()
    fresh = {"model": {k: torch.zeros_like(v) for k, v in state["model"].items()}, "n": 0}
    mc.load(fresh, path)
    assert fresh["n"] == 3
    for key, value in state["model"].items():
        assert torch.equal(fresh["model"][key], value), key
    with pytest.raises(mc.CheckpointError, match="overwrite=True"):
        mc.save(state, path, overwrite=False)
    mc.save({"model": state["model"], "n": 4}, path)  # overwrite replaces it atomically
    mc.load(fresh, path)
    assert fresh["n"] == 4 and not (tmp_path / "ckpt.old").exists()
    report = mc.describe(path)
    assert report["world_size"] == 1 and report["complete"] is True


def test_load_reports_every_mismatch(tmp_path: Path) -> None:
    mc.save({"model": {"a": torch.zeros(2), "b": torch.zeros(3)}, "other": 1}, tmp_path / "c")
    wrong = {"model": {"a": torch.zeros(5), "c": torch.zeros(1)}}
    with pytest.raises(mc.StateDictMismatchError) as caught:
        mc.load(wrong, tmp_path / "c")
    message = str(caught.value)
    assert "missing from the checkpoint: model.c" in message
    assert "unexpected (in the checkpoint, not in the state dict): model.b" in message
    assert "model.a (checkpoint (2,), state dict (5,))" in message
    assert "other" not in message  # sections not being loaded are not "unexpected"
    partial = {"model": {"a": torch.ones(2), "c": torch.ones(1)}}
    mc.load(partial, tmp_path / "c", strict=False)
    assert torch.equal(partial["model"]["a"], torch.zeros(2))


def test_enable_dcp_rejects_an_unsharded_model() -> None:
    with pytest.raises(ValueError, match="no fully-sharded module"):
        mc.enable_dcp(make_model())
    with pytest.raises(TypeError, match=r"model must be an nn\.Module"):
        mc.enable_dcp("model")  # type: ignore[arg-type]


def test_describe_a_torch_file(tmp_path: Path) -> None:
    torch.save({"w": torch.ones(2, 3, dtype=torch.float16), "meta": {"step": 1}}, tmp_path / "f")
    report = mc.describe(tmp_path / "f")
    assert report["format"] == "torch" and report["world_size"] is None
    assert report["tensors"] == [{"key": "w", "shape": [2, 3], "dtype": "float16", "bytes": 12}]
    assert report["objects"] == ["meta.step"]
