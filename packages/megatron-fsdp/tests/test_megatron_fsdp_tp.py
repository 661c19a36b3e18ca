"""FSDP x TP through fully_shard_model(..., tp_dim="tp"): parity, checkpoints and bad input.

A checkpoint saved on 4 ranks as (dp_shard=2, tp=2) resumes under plain FSDP on 2 and on 4
ranks and under 2x2 again, and training continues exactly; one saved under plain FSDP
resumes under FSDP x TP. HFSDP x TP (``outer_dp_sharding_strategy="optim"`` with ``tp_dim``)
runs as (dp_outer=2, dp_shard=1, tp=2) on 4 ranks and (2, 2, 2) on 8, where each TP
parameter's optimizer shard is a sub-shard whose (dp, tp) mesh coordinates are not sub-shard
order.
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Shard

from megatron_fsdp import fully_shard_model, fully_shard_optimizer
from mfsdp_checkpoint import gather_full_state_dict
from mfsdp_collectives.testing import run_distributed
from mfsdp_hooks.testing.tp import TP_OUT, TP_WIDTH, MLPBlock, megatron_tp_model, tp_model

STEPS = 10


def _hfsdp_tp_mesh(world: int, tp_size: int) -> tuple[DeviceMesh, dict[str, Any]]:
    """(dp_outer=2, dp_shard, tp=tp_size) and the HFSDP keywords for it."""
    shape = (2, world // (2 * tp_size), tp_size)
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=("dp_outer", "dp_shard", "tp"))
    hybrid = mesh["dp_outer", "dp_shard"]._flatten("dp").get_group()
    options = {
        "dp_outer_dim": "dp_outer",
        "hybrid_fsdp_group": hybrid,
        "outer_dp_sharding_strategy": "optim",
    }
    return mesh, options


def _wrap(
    tp: bool, world: int, megatron: bool = False, hfsdp: bool = False, tp_size: int = 2
) -> tuple[nn.Module, torch.optim.Optimizer, int]:
    """The MLP model under FSDP x TP (2x2; torch's DTensor TP, or ``megatron``-style layers),
    HFSDP x TP (``hfsdp``: 2 x world/(2 tp_size) x tp_size) or plain FSDP; returns its DP
    rank."""
    if tp:
        if hfsdp:
            mesh, options = _hfsdp_tp_mesh(world, tp_size)
            dp_mesh = mesh["dp_outer", "dp_shard"]._flatten("dp")
        else:
            mesh = init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("dp_shard", "tp"))
            dp_mesh, options = mesh["dp_shard"], {}
        tp_mesh = mesh["tp"]
        model = fully_shard_model(
            megatron_tp_model(tp_mesh) if megatron else tp_model("mlp", tp_mesh),
            fsdp_unit_modules=[MLPBlock],
            device_mesh=mesh,
            dp_shard_dim="dp_shard",
            tp_dim="tp",
            **options,
        )
        dp_rank, dp_size = dp_mesh.get_local_rank(), dp_mesh.size()
    else:
        model = fully_shard_model(tp_model("mlp", None), fsdp_unit_modules=[MLPBlock])
        dp_rank, dp_size = dist.get_rank(), world
    optimizer = fully_shard_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-2))
    return model, optimizer, dp_rank if dp_size > 1 else 0


def _steps(
    model: nn.Module, optimizer: torch.optim.Optimizer, dp: tuple[int, int], start: int, n: int
) -> list[float]:
    """Global-batch losses of ``n`` steps, each DP rank on its share of 8 samples."""
    dp_rank, dp_size = dp
    losses = []
    for step in range(start, start + n):
        gen = torch.Generator().manual_seed(step)
        x, y = torch.randn(8, 4, TP_WIDTH, generator=gen), torch.randn(8, 4, TP_OUT, generator=gen)
        loss = nn.functional.mse_loss(model(x.chunk(dp_size)[dp_rank]), y.chunk(dp_size)[dp_rank])
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses.append(total.item() / dist.get_world_size())
    return losses


def _parity_worker(
    rank: int, world: int, megatron: bool, hfsdp: bool = False, tp_size: int = 2
) -> tuple[list[float], list[float]]:
    model, optimizer, dp_rank = _wrap(True, world, megatron, hfsdp, tp_size)
    for name, param in model.named_parameters():
        # DTensor TP also keeps the replicated rowwise bias on the TP mesh; Megatron does not.
        tp_cut = "blocks" in name and not (megatron and name.endswith("down.bias"))
        assert isinstance(param, DTensor) and param.device_mesh.ndim == (2 if tp_cut else 1)
        if megatron and tp_cut:  # Megatron-Core's attributes survive the sharding
            assert param.tensor_model_parallel, name  # type: ignore[attr-defined]
            assert param.placements[1] == Shard(param.partition_dim), name  # type: ignore[attr-defined]
    reference = tp_model("mlp", None)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    want = []
    for step in range(STEPS):
        gen = torch.Generator().manual_seed(step)
        x, y = torch.randn(8, 4, TP_WIDTH, generator=gen), torch.randn(8, 4, TP_OUT, generator=gen)
        loss = nn.functional.mse_loss(reference(x), y)
        loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        want.append(loss.item())
    got = _steps(model, optimizer, (dp_rank, world // tp_size), 0, STEPS)
    for name, param in model.named_parameters():
        # the optimizer shards tile each parameter once per TP replica: under HFSDP they are
        # cut across dp_outer as well (HSDP would hold dp_outer copies)
        held = torch.tensor(float(param.to_local().numel()))
        dist.all_reduce(held)
        mesh, placements = param.device_mesh, param.placements
        replicas = 1 if mesh.ndim == 2 else tp_size  # TP replicas of one TP does not cut
        replicas *= math.prod(mesh.size(d) for d, p in enumerate(placements) if p.is_replicate())
        assert held.item() == param.numel() * replicas, (name, held.item(), param.numel())
    full = gather_full_state_dict(model, rank0_only=False)
    for name, value in reference.state_dict().items():
        key = name if name in full else f"module.{name}"
        torch.testing.assert_close(full[key], value, rtol=1e-5, atol=1e-6)
    return got, want


@pytest.mark.parametrize("megatron", [False, True])
def test_fully_shard_model_with_tp_dim_trains_as_one_process(megatron: bool) -> None:
    # torch's DTensor TP, and Megatron-Core-style TP layers (plain local tensors with
    # tensor_model_parallel / partition_dim, their own all-reduces).
    for got, want in run_distributed(_parity_worker, 4, megatron, timeout=240):
        for a, b in zip(got, want, strict=True):
            assert abs(a - b) <= 1e-5 * abs(b), (got, want)


FULL = os.environ.get("MFSDP_FULL_MATRIX") == "1"
FULL_ONLY = pytest.mark.skipif(not FULL, reason="MFSDP_FULL_MATRIX=1 only")


@pytest.mark.parametrize(
    ("world", "megatron", "tp_size"),
    [
        (4, False, 2),
        pytest.param(4, True, 2, marks=FULL_ONLY),  # the matrix's hfsdp_tp column has it
        # a TP dim of size 1: dp coordinates (2 x 2) are not sub-shard order at 4 ranks
        (4, True, 1),
        pytest.param(8, False, 2, marks=FULL_ONLY),
        pytest.param(8, True, 2, marks=FULL_ONLY),
    ],
)
def test_hfsdp_with_tp_dim_trains_as_one_process(world: int, megatron: bool, tp_size: int) -> None:
    for got, want in run_distributed(_parity_worker, world, megatron, True, tp_size, timeout=300):
        for a, b in zip(got, want, strict=True):
            assert abs(a - b) <= 1e-5 * abs(b), (got, want)


def _save_worker(
    rank: int, world: int, path: str, tp: bool, megatron: bool = False, hfsdp: bool = False
) -> list[float]:
    model, optimizer, dp_rank = _wrap(tp, world, megatron, hfsdp)
    dp = (dp_rank, world // 2 if tp else world)
    losses = _steps(model, optimizer, dp, 0, 3)
    dcp.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, checkpoint_id=path)
    return losses + _steps(model, optimizer, dp, 3, 3)


def _load_worker(rank: int, world: int, path: str, tp: bool, hfsdp: bool = False) -> list[float]:
    model, optimizer, dp_rank = _wrap(tp, world, hfsdp=hfsdp)
    state = {"model": model.state_dict(), "optimizer": optimizer.state_dict()}
    dcp.load(state_dict=state, checkpoint_id=path)
    model.load_state_dict(state["model"], strict=False)
    optimizer.load_state_dict(state["optimizer"])
    return _steps(model, optimizer, (dp_rank, world // 2 if tp else world), 3, 3)


@pytest.mark.parametrize(
    ("saved_tp", "world", "loaded_tp"), [(True, 2, False), (True, 4, False), (True, 4, True)]
)
def test_an_fsdp_x_tp_checkpoint_resumes_exactly(
    tmp_path: Path, saved_tp: bool, world: int, loaded_tp: bool
) -> None:
    path = str(tmp_path / "ckpt")
    uninterrupted = run_distributed(_save_worker, 4, path, saved_tp, timeout=180)[0]
    resumed = run_distributed(_load_worker, world, path, loaded_tp, timeout=180)[0]
    for got, want in zip(resumed, uninterrupted[3:], strict=True):
        assert abs(got - want) <= 1e-5 * abs(want), (resumed, uninterrupted)


@pytest.mark.parametrize(
    ("saved", "world", "loaded"),
    [
        ("hfsdp_tp", 2, "fsdp"),
        pytest.param("tp", 4, "hfsdp_tp", marks=FULL_ONLY),
        pytest.param("hfsdp_tp", 8, "hfsdp_tp", marks=FULL_ONLY),
    ],
)
def test_an_hfsdp_x_tp_checkpoint_resumes_exactly(
    tmp_path: Path, saved: str, world: int, loaded: str
) -> None:
    """The sub-shards of TP parameters land at their rows in the checkpoint: saved under
    HFSDP x TP it resumes under plain FSDP, and an FSDP x TP one resumes under HFSDP x TP."""
    path = str(tmp_path / "ckpt")
    save_world = 8 if world == 8 else 4
    saved_hfsdp, loaded_hfsdp = saved == "hfsdp_tp", loaded == "hfsdp_tp"
    args = (path, True, False, saved_hfsdp)
    uninterrupted = run_distributed(_save_worker, save_world, *args, timeout=240)[0]
    resumed = run_distributed(
        _load_worker, world, path, loaded != "fsdp", loaded_hfsdp, timeout=240
    )[0]
    for got, want in zip(resumed, uninterrupted[3:], strict=True):
        assert abs(got - want) <= 1e-5 * abs(want), (resumed, uninterrupted)


def test_a_megatron_style_tp_checkpoint_resumes_under_plain_fsdp(tmp_path: Path) -> None:
    path = str(tmp_path / "ckpt")
    uninterrupted = run_distributed(_save_worker, 4, path, True, True, timeout=180)[0]
    resumed = run_distributed(_load_worker, 2, path, False, timeout=180)[0]
    for got, want in zip(resumed, uninterrupted[3:], strict=True):
        assert abs(got - want) <= 1e-5 * abs(want), (resumed, uninterrupted)


def test_a_plain_fsdp_checkpoint_resumes_under_fsdp_x_tp(tmp_path: Path) -> None:
    path = str(tmp_path / "ckpt")
    uninterrupted = run_distributed(_save_worker, 2, path, False, timeout=180)[0]
    resumed = run_distributed(_load_worker, 4, path, True, timeout=180)[0]
    for got, want in zip(resumed, uninterrupted[3:], strict=True):
        assert abs(got - want) <= 1e-5 * abs(want), (resumed, uninterrupted)


def _tp_size_one_worker(rank: int, world: int) -> list[float]:
    """The reference passes a tp dim whenever it passes a mesh: a TP of size 1 is plain FSDP
    (Megatron-style layers of one TP rank hold whole weights)."""
    mesh = init_device_mesh("cpu", (world, 1), mesh_dim_names=("dp_shard", "tp"))
    model = fully_shard_model(
        megatron_tp_model(mesh["tp"]),
        fsdp_unit_modules=[MLPBlock],
        device_mesh=mesh,
        dp_shard_dim="dp_shard",
        tp_dim="tp",
    )
    optimizer = fully_shard_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-2))
    plain, plain_opt, _ = _wrap(False, world)
    got = _steps(model, optimizer, (rank, world), 0, STEPS)
    want = _steps(plain, plain_opt, (rank, world), 0, STEPS)
    assert got == want, (got, want)
    return got


def test_a_tp_dim_of_size_one_trains_as_plain_fsdp() -> None:
    run_distributed(_tp_size_one_worker, 2, timeout=180)
