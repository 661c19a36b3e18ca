"""Checkpoints of parameters cut along another dim than 0 (FSDP2's ``shard_placement_fn``
returning ``Shard(d)``): DCP chunks at the true ranges along ``d``, resumes onto the same cut
and onto dim-0 sharding on another world size, and full state dicts out and back in."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from checkpoint_models import (
    assert_rel,
    assert_states_equal,
    make_batches,
    make_model,
    make_optimizer,
    pack,
    shard,
    train,
    unpack,
)
from torch.distributed.tensor import Shard

import mfsdp_checkpoint as mc
from mfsdp_collectives.testing import run_distributed
from mfsdp_hooks import fsdp_units

STEPS, SAVE_AT = 10, 5


def _last_dim(param: torch.Tensor) -> Shard | None:
    return Shard(param.dim() - 1) if param.dim() > 1 else None


def _sharded(dims: str, seed: int = 0) -> torch.nn.Module:
    placement = _last_dim if dims == "last" else None
    return shard(make_model(seed=seed), 3, api="per_module", shard_placement_fn=placement)


def _check_chunks_along_dim_1(model: torch.nn.Module, path: Path) -> int:
    """Every cut parameter's chunks in the checkpoint are its layout ranges along dim 1."""
    metadata = mc.read_metadata(path)
    checked = 0
    for unit in fsdp_units(model):
        prefix = next(f"{n}." if n else "" for n, m in model.named_modules() if m is unit.module)
        for group in unit.groups:
            for index, name in enumerate(group.names):
                if group.layout.placements[index].shard_dim != 1:
                    continue
                chunks = metadata.state_dict_metadata[f"model.{prefix}{name}"].chunks  # type: ignore[union-attr]
                assert all(c.offsets[0] == 0 for c in chunks)
                saved = sorted((c.offsets[1], c.offsets[1] + c.sizes[1]) for c in chunks)
                expected = [r for r in group.layout.row_ranges(index) if r[0] != r[1]]
                assert saved == expected, f"{name}: chunks {saved} != layout ranges {expected}"
                checked += 1
    return checked


def _save_world(rank: int, world: int, path: str) -> dict[str, Any]:
    batches = make_batches(STEPS)
    model = _sharded("last")
    uninterrupted = train(model, make_optimizer(model), batches, rank, world)
    model = _sharded("last")
    optimizer = make_optimizer(model)
    mc.enable_dcp(model, optimizer)
    train(model, optimizer, batches[:SAVE_AT], rank, world)
    state = {"model": model.state_dict(), "optimizer": optimizer.state_dict()}
    dcp.save(state, checkpoint_id=path)
    checked = _check_chunks_along_dim_1(model, Path(path)) if rank == 0 else -1
    full = mc.gather_full_state_dict(model, rank0_only=False)
    return {"losses": uninterrupted, "full": pack(full), "checked": checked}


def _load_world(rank: int, world: int, path: str, dims: str) -> dict[str, Any]:
    batches = make_batches(STEPS)
    model = _sharded(dims, seed=1234)
    optimizer = make_optimizer(model)
    mc.enable_dcp(model, optimizer)
    state = {"model": model.state_dict(), "optimizer": optimizer.state_dict()}
    dcp.load(state, checkpoint_id=path)
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    loaded = mc.gather_full_state_dict(model, rank0_only=False)
    losses = train(model, optimizer, batches[SAVE_AT:], rank, world)
    # The full state dict back into a fresh model cut the same way gives the same weights.
    fresh = _sharded(dims, seed=99)
    mc.load_full_state_dict(fresh, mc.gather_full_state_dict(model, rank0_only=False))
    same = mc.gather_full_state_dict(fresh, rank0_only=False)
    trained = mc.gather_full_state_dict(model, rank0_only=False)
    return {"losses": losses, "loaded": pack(loaded), "same": pack(same), "trained": pack(trained)}


def test_dcp_resumes_dim_1_cuts_onto_the_same_cut_and_onto_dim_0_on_4_ranks(
    tmp_path: Path,
) -> None:
    path = str(tmp_path / "ckpt")
    saved = run_distributed(_save_world, 2, path, timeout=180)[0]
    assert saved["checked"] == 9
    full = unpack(saved["full"])
    assert any(v.dim() > 1 for v in full.values())
    loads = [(4, "rows", 1e-5)]
    if os.environ.get("MFSDP_FULL_MATRIX") == "1":
        loads.append((2, "last", 1e-6))
    for world, dims, rtol in loads:
        result = run_distributed(_load_world, world, path, dims, timeout=180)[0]
        what = f"2 ranks, last dims -> {world} ranks, {dims}"
        assert_states_equal(unpack(result["loaded"]), full, f"{what}: loaded weights")
        assert_rel(result["losses"], saved["losses"][SAVE_AT:], rtol, what)
        assert_states_equal(unpack(result["same"]), unpack(result["trained"]), f"{what}: full")
