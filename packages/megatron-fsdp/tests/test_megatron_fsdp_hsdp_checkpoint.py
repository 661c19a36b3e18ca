"""A DCP checkpoint saved under HSDP (4 ranks as 2x2) resumes exactly in plain FSDP."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from test_megatron_fsdp_checkpoint import Layer, _steps
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

from megatron_fsdp import fully_shard_model, fully_shard_optimizer
from mfsdp_collectives.testing import run_distributed


def _build(seed: int, hsdp: bool) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    mesh_args: dict[str, object] = {}
    if hsdp:
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_outer", "dp_shard"))
        mesh_args = {
            "device_mesh": mesh,
            "dp_shard_dim": "dp_shard",
            "dp_outer_dim": "dp_outer",
            "hybrid_fsdp_group": dist.group.WORLD,
        }
    model = fully_shard_model(
        nn.Sequential(Layer(), Layer(), nn.Linear(7, 3)),
        fsdp_unit_modules=[Layer],
        **mesh_args,  # type: ignore[arg-type]
    )
    optimizer = fully_shard_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-2))
    return model, optimizer


def _save_worker(rank: int, world: int, path: str) -> list[float]:
    model, optimizer = _build(seed=0, hsdp=True)
    losses = _steps(model, optimizer, rank, world, 3, start=0)
    dcp.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, checkpoint_id=path)
    return losses + _steps(model, optimizer, rank, world, 3, start=3)


def _load_worker(rank: int, world: int, path: str, hsdp: bool) -> list[float]:
    model, optimizer = _build(seed=123, hsdp=hsdp)  # a different init, overwritten
    state = {"model": model.state_dict(), "optimizer": optimizer.state_dict()}
    dcp.load(state_dict=state, checkpoint_id=path)
    model.load_state_dict(state["model"], strict=False)
    optimizer.load_state_dict(state["optimizer"])
    return _steps(model, optimizer, rank, world, 3, start=3)


@pytest.mark.parametrize(("world", "hsdp"), [(2, False), (4, False), (4, True)])
def test_an_hsdp_checkpoint_resumes_exactly(tmp_path: Path, world: int, hsdp: bool) -> None:
    path = str(tmp_path / "ckpt")
    uninterrupted = run_distributed(_save_worker, 4, path, timeout=180)[0]
    resumed = run_distributed(_load_worker, world, path, hsdp, timeout=180)[0]
    for got, want in zip(resumed, uninterrupted[3:], strict=True):
        assert abs(got - want) <= 1e-5 * abs(want), (resumed, uninterrupted)
