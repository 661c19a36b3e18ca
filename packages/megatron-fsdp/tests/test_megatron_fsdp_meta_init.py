"""The seed's init_model_with_meta_device, then weights loaded from a full state dict.

Megatron-Bridge users hit "meta init, then random weights" (NVIDIA-NeMo/Megatron-Bridge#1552):
initialising on meta gives a model with fresh random weights; the trained ones must be loaded
after wrapping, which ``mfsdp_checkpoint.load_full_state_dict`` does shard by shard.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import save_file
from test_megatron_fsdp_api import Layer, _model

from megatron_fsdp import fully_shard_model
from mfsdp_checkpoint import gather_full_state_dict, load_full_state_dict
from mfsdp_collectives.testing import run_distributed


def _full(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return gather_full_state_dict(model, rank0_only=False)


def _meta_then_load(rank: int, world: int, path: str, expected: str) -> None:
    with torch.device("meta"):
        meta = torch.nn.Sequential(Layer(), Layer(), torch.nn.Linear(6, 1))
    torch.manual_seed(0)
    model = fully_shard_model(meta, fsdp_unit_modules=[Layer], init_model_with_meta_device=True)
    initialised = _full(model.module)
    direct = _model()  # torch.manual_seed(0) then built on the CPU
    for name, value in direct.state_dict().items():
        assert torch.equal(initialised[name], value), f"meta init differs from direct: {name}"
    load_full_state_dict(model.module, path)  # the trained weights, streamed shard by shard
    trained = torch.load(expected)
    loaded = _full(model.module)
    for name, value in trained.items():
        assert torch.equal(loaded[name], value), f"{name} was not loaded"
    out = model(torch.ones(2, 6)).sum()
    dist.all_reduce(out)
    assert torch.isfinite(out)


@pytest.mark.parametrize("layout", ["file", "hf_directory"])
def test_meta_init_then_load_full_state_dict(tmp_path: Path, layout: str) -> None:
    torch.manual_seed(123)
    trained = torch.nn.Sequential(Layer(), Layer(), torch.nn.Linear(6, 1)).state_dict()
    tensors = {k: v.contiguous() for k, v in trained.items()}
    expected = str(tmp_path / "trained.pt")
    torch.save(trained, expected)
    if layout == "file":
        path = str(tmp_path / "model.safetensors")
        save_file(tensors, path)
    else:  # a Hugging Face model directory: the weights split over two files and an index
        directory = tmp_path / "hf_model"
        directory.mkdir()
        names = list(tensors)
        half = len(names) // 2
        weight_map = {}
        for part, keys in enumerate((names[:half], names[half:]), start=1):
            file = f"model-{part:05d}-of-00002.safetensors"
            save_file({k: tensors[k] for k in keys}, str(directory / file))
            weight_map.update({k: file for k in keys})
        index = {"metadata": {}, "weight_map": weight_map}
        (directory / "model.safetensors.index.json").write_text(json.dumps(index))
        path = str(directory)
    run_distributed(_meta_then_load, 2, path, expected, timeout=120)
