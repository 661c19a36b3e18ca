"""FSDP2's ``shard_placement_fn`` returning ``Shard(d)`` for ``d != 0``.

Side by side with torch's FSDP2 on the same CPU ranks (which needs dim ``d`` to split evenly):
the same losses, ``Shard(d)`` placements of the parameters and their gradients, full tensors
and clipped norm. Ours also cuts uneven dims, and under HFSDP: at parity with one process.
"""

from __future__ import annotations

import os
from functools import partial
from typing import Any

import pytest
import torch
import torch.distributed as dist
from hooks_models import (
    hfsdp_topology,
    loss_fn,
    make_batches,
    make_model,
    make_optimizer,
    shard_blocks,
)
from torch import nn
from torch.distributed.tensor import DTensor, Shard

from mfsdp_collectives.testing import run_distributed
from mfsdp_hooks.testing.parity import ParityCase, run_parity

STEPS = 10
_FULL_ONLY = pytest.mark.skipif(
    os.environ.get("MFSDP_FULL_MATRIX") != "1", reason="MFSDP_FULL_MATRIX=1 only"
)


class _EvenBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(12, 16)
        self.fc2 = nn.Linear(16, 12)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(torch.relu(self.fc1(x)))


class _EvenModel(nn.Module):
    """Every dim even, so FSDP2 (which refuses uneven ``Shard(d)`` for d != 0) can run it."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList(_EvenBlock() for _ in range(2))
        self.out = nn.Linear(12, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.out(x)


def _step(model: nn.Module, step: int, rank: int, world: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(step)
    inputs, targets = (
        torch.randn(8, 12, generator=generator),
        torch.randn(8, 4, generator=generator),
    )
    rows = slice(rank * 8 // world, (rank + 1) * 8 // world)
    loss = nn.functional.mse_loss(model(inputs[rows]), targets[rows])
    loss.backward()
    return loss


def _fsdp2_worker(rank: int, world: int, impl: str) -> dict[str, Any]:
    model = _EvenModel()
    shard_blocks(model, impl, shard_placement_fn=lambda p: Shard(1) if p.dim() > 1 else None)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for step in range(STEPS):
        losses.append(_step(model, step, rank, world).item())
        optimizer.step()
        optimizer.zero_grad()
    _step(model, STEPS, rank, world)  # leaves its gradients for clipping
    grads = {n: p.grad for n, p in model.named_parameters() if isinstance(p.grad, DTensor)}
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
    state = model.state_dict()
    return {
        "losses": losses,
        "placements": {k: v.placements for k, v in state.items() if isinstance(v, DTensor)},
        "grad_placements": {n: g.placements for n, g in grads.items()},
        "clipped": {n: g.full_tensor().tolist() for n, g in grads.items()},
        "norm": float(norm.full_tensor() if isinstance(norm, DTensor) else norm),
        "full": {k: v.full_tensor().tolist() for k, v in state.items() if isinstance(v, DTensor)},
    }


def test_shard_dim_1_trains_as_fsdp2_with_the_same_placements_grads_and_norm() -> None:
    ours = run_distributed(_fsdp2_worker, 2, "ours", timeout=120)
    theirs = run_distributed(_fsdp2_worker, 2, "fsdp2", timeout=120)
    for mine, fsdp2 in zip(ours, theirs, strict=True):
        for a, b in zip(mine["losses"], fsdp2["losses"], strict=True):
            assert abs(a - b) <= 1e-5 * abs(b), (mine["losses"], fsdp2["losses"])
        assert mine["placements"] == fsdp2["placements"]
        assert mine["grad_placements"] == fsdp2["grad_placements"]
        assert sum(p == (Shard(1),) for p in mine["placements"].values()) == 5
        assert abs(mine["norm"] - fsdp2["norm"]) <= 1e-5 * fsdp2["norm"]
        for what in ("full", "clipped"):
            for key, value in mine[what].items():
                torch.testing.assert_close(
                    torch.tensor(value), torch.tensor(fsdp2[what][key]), rtol=1e-5, atol=1e-6
                )


def _last_dim(param: torch.Tensor) -> Shard | None:
    return Shard(-1) if param.dim() > 1 else None


def _along_last_dims(model: nn.Module, hfsdp: bool) -> nn.Module:
    """Every 2-D parameter cut along its last dim, whatever its size."""
    options: dict[str, Any] = {"shard_placement_fn": _last_dim}
    if hfsdp:
        options["mesh"] = hfsdp_topology(2, dist.get_world_size() // 2)
    shard_blocks(model, **options)
    state = model.state_dict().values()
    assert sorted({v.placements[0].dim for v in state if isinstance(v, DTensor)}) == [0, 1]
    return model


def _assert_as_one_process(world: int, hfsdp: bool) -> None:
    shard = partial(_along_last_dims, hfsdp=hfsdp)
    optimizer = partial(make_optimizer, "adamw")
    run_parity(world, [ParityCase(f"last dims hfsdp={hfsdp}", shard, optimizer=optimizer)])


def test_shard_along_uneven_last_dims_matches_one_process_on_4_ranks() -> None:
    _assert_as_one_process(4, hfsdp=False)


@_FULL_ONLY
def test_shard_along_last_dims_under_hfsdp_matches_one_process() -> None:
    _assert_as_one_process(4, hfsdp=True)


_VARIANTS = {
    "no_shard": {"sharding_strategy": 0},
    "zero1": {"sharding_strategy": 1},
    "zero2": {"sharding_strategy": 2},
    "keep_after_forward": {"reshard_after_forward": False},
    "bf16": {"mp_policy": "bf16"},
    "accumulate": {},
}


def _variant_worker(rank: int, world: int, variant: str, cut: bool) -> dict[str, Any]:
    """Two micro-batches a step (the first without gradient sync for ``accumulate``)."""
    from mfsdp_hooks import MixedPrecisionPolicy

    options = dict(_VARIANTS[variant])
    if options.get("mp_policy") == "bf16":
        options["mp_policy"] = MixedPrecisionPolicy(
            param_dtype=torch.bfloat16, reduce_dtype=torch.float32
        )
    if cut:
        options["shard_placement_fn"] = lambda p: Shard(1) if p.dim() > 1 else None
    model = make_model()
    shard_blocks(model, "ours", **options)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    losses = []
    for tokens, targets in make_batches(STEPS):
        for micro in range(2):
            sync = variant != "accumulate" or micro == 1
            model.set_requires_gradient_sync(sync)  # type: ignore[operator]
            rows = slice(
                (2 * rank + micro) * 12 // (2 * world), (2 * rank + micro + 1) * 12 // (2 * world)
            )
            loss = loss_fn(model(tokens[rows]), targets[rows]) / 2
            loss.backward()
            losses.append(loss.item())
        optimizer.step()
        optimizer.zero_grad()
    state = model.state_dict()
    return {
        "losses": losses,
        "full": {
            k: (v.full_tensor() if isinstance(v, DTensor) else v).float().tolist()
            for k, v in state.items()
        },
    }


@pytest.mark.parametrize(
    "variant",
    [v if v == "accumulate" else pytest.param(v, marks=_FULL_ONLY) for v in _VARIANTS],
)
def test_cutting_along_dim_1_trains_as_dim_0_under_every_strategy_and_precision(
    variant: str,
) -> None:
    """Only the layout differs, so the two runs agree to float rounding (each element is
    reduced over the same ranks in the same order either way)."""
    rows = run_distributed(_variant_worker, 2, variant, False, timeout=120)
    cols = run_distributed(_variant_worker, 2, variant, True, timeout=120)
    for a, b in zip(rows, cols, strict=True):
        assert a["losses"] == pytest.approx(b["losses"], rel=1e-6), variant
        for key, value in a["full"].items():
            torch.testing.assert_close(
                torch.tensor(b["full"][key]), torch.tensor(value), rtol=1e-6, atol=1e-7
            )
