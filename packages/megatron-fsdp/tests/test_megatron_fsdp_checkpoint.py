"""The seed README's DCP snippet works as written on the public API."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

from megatron_fsdp import fully_shard_model, fully_shard_optimizer
from mfsdp_collectives.testing import run_distributed


class Layer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(7, 7)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.linear(x)) + x


def _hybrid_args(hybrid: str) -> dict[str, object]:
    """Plain FSDP (""), or on 4 ranks as (dp_outer=2, dp_shard=2) "hsdp" or "hfsdp"."""
    if not hybrid:
        return {}
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_outer", "dp_shard"))
    return {
        "device_mesh": mesh,
        "dp_shard_dim": "dp_shard",
        "dp_outer_dim": "dp_outer",
        "hybrid_fsdp_group": dist.group.WORLD,
        "outer_dp_sharding_strategy": "optim" if hybrid == "hfsdp" else "no_shard",
    }


def _build(seed: int, strategy: int, hybrid: str = "") -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = fully_shard_model(
        nn.Sequential(Layer(), Layer(), nn.Linear(7, 3)),
        fsdp_unit_modules=[Layer],
        zero_dp_strategy=strategy,
        **_hybrid_args(hybrid),  # type: ignore[arg-type]
    )
    optimizer = fully_shard_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-2))
    return model, optimizer


def _steps(
    model: nn.Module, optimizer: torch.optim.Optimizer, rank: int, world: int, n: int, start: int
) -> list[float]:
    losses = []
    for step in range(start, start + n):
        batch = torch.randn(12, 7, generator=torch.Generator().manual_seed(step))
        loss = model(batch.chunk(world)[rank]).pow(2).mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        total = loss.detach().clone()
        torch.distributed.all_reduce(total)
        losses.append(total.item() / world)
    return losses


def _save_worker(rank: int, world: int, path: str, hybrid: str = "") -> list[float]:
    model, optimizer = _build(seed=0, strategy=3, hybrid=hybrid)
    losses = _steps(model, optimizer, rank, world, 3, start=0)
    dcp.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, checkpoint_id=path)
    return losses + _steps(model, optimizer, rank, world, 3, start=3)


def _load_worker(rank: int, world: int, path: str, strategy: int, hybrid: str = "") -> list[float]:
    model, optimizer = _build(seed=123, strategy=strategy, hybrid=hybrid)  # another init
    ckpt_state_dict = {"model": model.state_dict(), "optimizer": optimizer.state_dict()}
    dcp.load(state_dict=ckpt_state_dict, checkpoint_id=path)
    model.load_state_dict(ckpt_state_dict["model"], strict=False)
    optimizer.load_state_dict(ckpt_state_dict["optimizer"])
    return _steps(model, optimizer, rank, world, 3, start=3)


@pytest.mark.parametrize(("world", "strategy"), [(2, 3), (3, 2)])
def test_seed_snippet_saves_and_resumes(tmp_path: Path, world: int, strategy: int) -> None:
    path = str(tmp_path / "ckpt")
    uninterrupted = run_distributed(_save_worker, 2, path, timeout=120)[0]
    resumed = run_distributed(_load_worker, world, path, strategy, timeout=120)[0]
    for got, want in zip(resumed, uninterrupted[3:], strict=True):
        assert abs(got - want) <= 1e-5 * abs(want), (resumed, uninterrupted)


@pytest.mark.parametrize(
    ("saved", "world", "loaded"),
    [
        ("hsdp", 2, ""),
        ("hsdp", 4, ""),
        ("hsdp", 4, "hsdp"),
        ("hsdp", 4, "hfsdp"),
        ("hfsdp", 2, ""),
        ("hfsdp", 4, "hsdp"),
    ],
)
def test_a_hybrid_checkpoint_resumes_exactly(
    tmp_path: Path, saved: str, world: int, loaded: str
) -> None:
    """Saved on 4 ranks as 2x2 (HSDP, or HFSDP with the optimizer state cut across dp_outer);
    resumed in plain FSDP on 2 and 4 ranks, in HSDP and in HFSDP."""
    path = str(tmp_path / "ckpt")
    uninterrupted = run_distributed(_save_worker, 4, path, saved, timeout=180)[0]
    resumed = run_distributed(_load_worker, world, path, 3, loaded, timeout=180)[0]
    for got, want in zip(resumed, uninterrupted[3:], strict=True):
        assert abs(got - want) <= 1e-5 * abs(want), (resumed, uninterrupted)
