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
from functools import partial
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
from mfsdp_hooks import fsdp_units
from mfsdp_hooks.testing.parity import ParityCase, run_parity
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


def _shard(
    model: nn.Module | None,
    tp: bool,
    megatron: bool = False,
    hfsdp: bool = False,
    tp_size: int = 2,
) -> nn.Module:
    """The MLP model under FSDP x TP (2x2; torch's DTensor TP, or ``megatron``-style layers),
    HFSDP x TP (``hfsdp``: 2 x world/(2 tp_size) x tp_size) or plain FSDP (built here: TP
    cuts it first)."""
    if not tp:
        return fully_shard_model(tp_model("mlp", None), fsdp_unit_modules=[MLPBlock])
    world = dist.get_world_size()
    if hfsdp:
        mesh, options = _hfsdp_tp_mesh(world, tp_size)
    else:
        mesh = init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("dp_shard", "tp"))
        options = {}
    tp_mesh = mesh["tp"]
    return fully_shard_model(
        megatron_tp_model(tp_mesh) if megatron else tp_model("mlp", tp_mesh),
        fsdp_unit_modules=[MLPBlock],
        device_mesh=mesh,
        dp_shard_dim="dp_shard",
        tp_dim="tp",
        **options,
    )


def _wrap(
    tp: bool, megatron: bool = False, hfsdp: bool = False
) -> tuple[nn.Module, torch.optim.Optimizer, int]:
    """:func:`_shard`'s model, its optimizer and its DP rank (TP pairs are consecutive ranks)."""
    model = _shard(None, tp, megatron, hfsdp)
    optimizer = fully_shard_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-2))
    return model, optimizer, dist.get_rank() // 2 if tp else dist.get_rank()


def _batches(n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``n`` global batches of 8 sequences of 4."""
    out = []
    for step in range(n):
        gen = torch.Generator().manual_seed(step)
        x = torch.randn(8, 4, TP_WIDTH, generator=gen)
        out.append((x, torch.randn(8, 4, TP_OUT, generator=gen)))
    return out


def _steps(
    model: nn.Module, optimizer: torch.optim.Optimizer, dp: tuple[int, int], start: int, n: int
) -> list[float]:
    """Global-batch losses of ``n`` steps, each DP rank on its share of 8 samples."""
    dp_rank, dp_size = dp
    losses = []
    for x, y in _batches(start + n)[start:]:
        loss = nn.functional.mse_loss(model(x.chunk(dp_size)[dp_rank]), y.chunk(dp_size)[dp_rank])
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses.append(total.item() / dist.get_world_size())
    return losses


def _tp_sharded(model: nn.Module, megatron: bool, hfsdp: bool, tp_size: int) -> nn.Module:
    model = _shard(model, True, megatron, hfsdp, tp_size)
    for name, param in model.named_parameters():
        # DTensor TP also keeps the replicated rowwise bias on the TP mesh; Megatron does not.
        tp_cut = "blocks" in name and not (megatron and name.endswith("down.bias"))
        assert isinstance(param, DTensor) and param.device_mesh.ndim == (2 if tp_cut else 1)
        if megatron and tp_cut:  # Megatron-Core's attributes survive the sharding
            assert param.tensor_model_parallel, name  # type: ignore[attr-defined]
            assert param.placements[1] == Shard(param.partition_dim), name  # type: ignore[attr-defined]
        # the optimizer shards tile each parameter once per TP replica: under HFSDP they are
        # cut across dp_outer as well (HSDP would hold dp_outer copies)
        held = torch.tensor(float(param.to_local().numel()))
        dist.all_reduce(held)
        mesh, placements = param.device_mesh, param.placements
        replicas = 1 if mesh.ndim == 2 else tp_size  # TP replicas of one TP does not cut
        replicas *= math.prod(mesh.size(d) for d, p in enumerate(placements) if p.is_replicate())
        assert held.item() == param.numel() * replicas, (name, held.item(), param.numel())
    return model


def _gathered(model: nn.Module) -> dict[str, torch.Tensor]:
    """``gather_full_state_dict``'s full weights (the model's own when it is not sharded)."""
    if not fsdp_units(model):
        return {name: value.detach() for name, value in model.state_dict().items()}
    full = gather_full_state_dict(model, rank0_only=False)
    return {name.removeprefix("module."): value for name, value in full.items()}


def _tp_case(megatron: bool, hfsdp: bool = False, tp_size: int = 2) -> ParityCase:
    return ParityCase(
        f"megatron={megatron} hfsdp={hfsdp} tp_size={tp_size}",
        partial(_tp_sharded, megatron=megatron, hfsdp=hfsdp, tp_size=tp_size),
        model=partial(tp_model, "mlp", None),
        sharded_optimizer=fully_shard_optimizer,
        batches=_batches,
        loss=nn.functional.mse_loss,
        share=tp_size,  # the TP group takes one share
        weights=_gathered,
    )


def test_fully_shard_model_with_tp_dim_trains_as_one_process() -> None:
    # torch's DTensor TP, and Megatron-Core-style TP layers (plain local tensors with
    # tensor_model_parallel / partition_dim, their own all-reduces).
    run_parity(4, [_tp_case(False), _tp_case(True)])


FULL = os.environ.get("MFSDP_FULL_MATRIX") == "1"
FULL_ONLY = pytest.mark.skipif(not FULL, reason="MFSDP_FULL_MATRIX=1 only")


@pytest.mark.parametrize(
    ("world", "layouts"),  # (megatron, tp_size)
    [
        # a TP dim of size 1: dp coordinates (2 x 2) are not sub-shard order at 4 ranks
        pytest.param(4, [(False, 2), (True, 1)], id="4"),
        # the matrix's hfsdp_tp column has it
        pytest.param(4, [(True, 2)], marks=FULL_ONLY, id="4-megatron"),
        pytest.param(8, [(False, 2), (True, 2)], marks=FULL_ONLY, id="8"),
    ],
)
def test_hfsdp_with_tp_dim_trains_as_one_process(
    world: int, layouts: list[tuple[bool, int]]
) -> None:
    run_parity(world, [_tp_case(megatron, True, tp_size) for megatron, tp_size in layouts], 300)


def _save_worker(
    rank: int, world: int, path: str, tp: bool, megatron: bool = False, hfsdp: bool = False
) -> list[float]:
    model, optimizer, dp_rank = _wrap(tp, megatron, hfsdp)
    dp = (dp_rank, world // 2 if tp else world)
    losses = _steps(model, optimizer, dp, 0, 3)
    dcp.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, checkpoint_id=path)
    return losses + _steps(model, optimizer, dp, 3, 3)


def _load_worker(rank: int, world: int, path: str, tp: bool, hfsdp: bool = False) -> list[float]:
    model, optimizer, dp_rank = _wrap(tp, hfsdp=hfsdp)
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
    plain, plain_opt, _ = _wrap(False)
    got = _steps(model, optimizer, (rank, world), 0, STEPS)
    want = _steps(plain, plain_opt, (rank, world), 0, STEPS)
    assert got == want, (got, want)
    return got


def test_a_tp_dim_of_size_one_trains_as_plain_fsdp() -> None:
    run_distributed(_tp_size_one_worker, 2, timeout=180)
