"""Resume exactness and resharding through the seed README's DCP snippet.

Ten uninterrupted steps versus five steps, a save, then fresh processes with a different random
init that load and take the last five steps: fp32 losses equal to 1e-6 (relative) on the same
world size, within 1e-5 on another world size or sharding strategy with the same global batch.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
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

import mfsdp_checkpoint as mc
from mfsdp_collectives.testing import run_distributed
from mfsdp_hooks import fsdp_units

STEPS, SAVE_AT = 10, 5
SAME_WORLD_RTOL, OTHER_WORLD_RTOL = 1e-6, 1e-5
_COLLECTIVES = (
    "all_gather",
    "all_gather_object",
    "all_gather_into_tensor",
    "all_reduce",
    "broadcast",
    "broadcast_object_list",
    "gather",
    "reduce_scatter_tensor",
    "barrier",
)


def _count_collectives(fn: Any) -> int:
    """How many torch.distributed collectives ``fn()`` issues."""
    calls = [0]
    originals = {name: getattr(dist, name) for name in _COLLECTIVES}

    def counting(original: Any) -> Any:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            calls[0] += 1
            return original(*args, **kwargs)

        return wrapper

    for name, original in originals.items():
        setattr(dist, name, counting(original))
    try:
        fn()
    finally:
        for name, original in originals.items():
            setattr(dist, name, original)
    return calls[0]


def _check_metadata_rows(model: torch.nn.Module, path: Path) -> None:
    """The checkpoint's chunks of every sharded parameter are the layout's true row ranges."""
    metadata = mc.read_metadata(path)
    prefix = "model.module."
    for unit in fsdp_units(model):
        for group in unit.groups:
            for index, name in enumerate(group.names):
                key = prefix + (f"{_unit_prefix(model, unit.module)}{name}")
                chunks = metadata.state_dict_metadata[key].chunks  # type: ignore[union-attr]
                saved = sorted((c.offsets[0], c.offsets[0] + c.sizes[0]) for c in chunks)
                expected = [r for r in group.layout.row_ranges(index) if r[0] != r[1]]
                assert saved == expected, f"{key}: chunks {saved} != layout rows {expected}"


def _unit_prefix(model: torch.nn.Module, module: torch.nn.Module) -> str:
    inner = model.module  # type: ignore[union-attr]
    for name, candidate in inner.named_modules():
        if candidate is module:
            return f"{name}." if name else ""
    raise AssertionError("unit module not found")


def _save_world(rank: int, world: int, path: str, strategy: int, api: str) -> dict[str, Any]:
    batches = make_batches(STEPS)
    model = shard(make_model(), strategy)
    uninterrupted = train(model, make_optimizer(model), batches, rank, world)

    model = shard(make_model(), strategy)
    optimizer = make_optimizer(model)
    mc.enable_dcp(model, optimizer)
    first = train(model, optimizer, batches[:SAVE_AT], rank, world)
    assert first == uninterrupted[:SAVE_AT]
    collectives = _count_collectives(lambda: (model.state_dict(), optimizer.state_dict()))
    assert collectives == 0, f"state_dict() issued {collectives} collectives"
    if api == "seed":
        dcp.save(
            {"model": model.state_dict(), "optimizer": optimizer.state_dict()},
            checkpoint_id=path,
        )
    else:
        mc.save_checkpoint(path, model, optimizer)
    if rank == 0:
        _check_metadata_rows(model, Path(path))
    return {"losses": uninterrupted, "full": pack(mc.gather_full_state_dict(model))}


def _load_world(
    rank: int, world: int, loads: list[tuple[str, int, str]]
) -> list[tuple[list[float], bytes]]:
    """Each load: a fresh model (another init), load the checkpoint, train the last steps."""
    batches = make_batches(STEPS)
    results = []
    for path, strategy, api in loads:
        model = shard(make_model(seed=1234), strategy)
        optimizer = make_optimizer(model)
        if api == "seed":
            mc.enable_dcp(model, optimizer)
            state = {"model": model.state_dict(), "optimizer": optimizer.state_dict()}
            dcp.load(state, checkpoint_id=path)
            model.load_state_dict(state["model"], strict=False)
            optimizer.load_state_dict(state["optimizer"])
        elif api == "split":  # optimizer first (weights untouched), then the weights
            before = mc.gather_full_state_dict(model)
            mc.load_checkpoint(path, model, optimizer, weights=False)
            after = mc.gather_full_state_dict(model)
            assert all(torch.equal(after[k], v) for k, v in before.items())
            mc.load_checkpoint(path, model)
        else:
            mc.load_checkpoint(path, model, optimizer)
        full = pack(mc.gather_full_state_dict(model))
        results.append((train(model, optimizer, batches[SAVE_AT:], rank, world), full))
    return results


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> dict[int, dict[str, Any]]:
    """Checkpoints after five steps: on 2 ranks (seed snippet) and 4 ranks (save_checkpoint)."""
    root = tmp_path_factory.mktemp("resume")
    out = {}
    for world, api in ((2, "seed"), (4, "helpers")):
        path = str(root / f"world{world}")
        result = run_distributed(_save_world, world, path, 3, api, timeout=180)[0]
        out[world] = {"path": path, "losses": result["losses"], "full": unpack(result["full"])}
    return out


def _check(
    saved: dict[str, Any], result: tuple[list[float], bytes], rtol: float, what: str
) -> None:
    losses, full = result
    assert_states_equal(unpack(full), saved["full"], f"{what}: loaded weights")
    assert_rel(losses, saved["losses"][SAVE_AT:], rtol, what)


def test_resume_same_world_is_exact_and_reshards_across_strategies(
    saved: dict[int, dict[str, Any]],
) -> None:
    """2 ranks: same strategy (exact), 3 -> 2 and 3 -> 0; 4 -> 2 ranks; and the optimizer
    alone (``weights=False``, leaving the weights as they are) before the weights."""
    two, four = saved[2], saved[4]
    loads = [
        (two["path"], 3, "seed"),
        (two["path"], 2, "seed"),
        (two["path"], 0, "helpers"),
        (four["path"], 3, "helpers"),  # save_checkpoint names the state: load_checkpoint
        (two["path"], 3, "split"),
    ]
    results = run_distributed(_load_world, 2, loads, timeout=180)[0]
    _check(two, results[0], SAME_WORLD_RTOL, "2 -> 2 ranks")
    _check(two, results[1], OTHER_WORLD_RTOL, "strategy 3 -> 2")
    _check(two, results[2], OTHER_WORLD_RTOL, "strategy 3 -> 0")
    _check(four, results[3], OTHER_WORLD_RTOL, "4 -> 2 ranks")
    _check(two, results[4], SAME_WORLD_RTOL, "2 -> 2 ranks, optimizer then weights")


@pytest.mark.parametrize("world", [3, 1])
def test_resume_on_another_world_size(saved: dict[int, dict[str, Any]], world: int) -> None:
    """2 -> 3 and 2 -> 1 ranks (the latter with the helpers), same global batch."""
    api = "seed" if world == 3 else "helpers"
    result = run_distributed(_load_world, world, [(saved[2]["path"], 3, api)], timeout=180)[0]
    _check(saved[2], result[0], OTHER_WORLD_RTOL, f"2 -> {world} ranks")
