"""What is gathered when: the options that shape the all-gather schedule, measured by the
unsharded block weights live while each block's leaves run forward (3 blocks of a norm and
two 64x256 Linears, 2 ranks; 4 with MFSDP_FULL_MATRIX=1), the all-gathers per step, and
parity with one process to 1e-5 over 10 steps.

* ``enable_fine_grained_param_gather=True`` (the seed API; the reference's class takes
  ``megatron_fsdp_enable_fine_grained_param_gather`` and ``enable_fine_grained_param_gather_hook``):
  each parameter-holding leaf of a unit is gathered just before it runs, prefetched one
  ahead: two leaves live instead of two blocks, one all-gather per leaf (the entry-point
  matrix's ``fine_grained`` column checks parity through every entry point).
* ``ddp_config.bucket_size``: a unit's collectives of at most so many elements; what is
  live does not change.
* ``ddp_config.suggested_communication_unit_size``: the elements gathered ahead (less than
  a unit: no prefetch), and small units merged into one all-gather up to it: on 32 small
  blocks, four blocks to a collective (18 all-gathers per step against 65), counted, with
  the same live window and bit-identical weights.

The last two through each entry point that takes them: the reference's class, the
Megatron-Core adapter (the same config fields) and the per-module ``fully_shard``
(``max_bucket_numel``, ``prefetch_numel``).
"""

from __future__ import annotations

import math
import os
from typing import Any

import pytest
import torch
from mcore_stand_ins import mcore_chunk, mcore_step
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

import mfsdp_hooks
from megatron_fsdp import (
    DistributedDataParallelConfig,
    FSDPDistributedIndex,
    MegatronFSDP,
    fully_shard_model,
    fully_shard_optimizer,
)
from megatron_fsdp.mcore import MCoreFSDPModel
from mfsdp_collectives import CommTracer
from mfsdp_collectives.testing import run_distributed
from mfsdp_hooks import fsdp_units
from mfsdp_hooks.testing import Block, assert_close_rel, local_slice

STEPS = 10
FULL = os.environ.get("MFSDP_FULL_MATRIX") == "1"
WIDTH, HIDDEN = 64, 256  # leaves large enough that the buffers' alignment padding is small
# (blocks, width, hidden): 3 wide blocks, or 32 small ones (communication-latency bound)
SHAPES = {"wide": (3, WIDTH, HIDDEN), "small": (32, 16, 32)}


def _model(shape: str = "wide") -> nn.Module:
    blocks, width, hidden = SHAPES[shape]
    torch.manual_seed(0)
    return nn.Sequential(*(Block(width, hidden) for _ in range(blocks)), nn.Linear(width, 1))


def _batches(world: int, shape: str = "wide") -> list[tuple[torch.Tensor, torch.Tensor]]:
    width = SHAPES[shape][1]
    gen = torch.Generator().manual_seed(0)
    return [
        (torch.randn(4 * world, width, generator=gen), torch.randn(4 * world, 1, generator=gen))
        for _ in range(STEPS)
    ]


def _optimizer(model: nn.Module) -> torch.optim.Optimizer:
    """SGD: Adam turns the rounding noise of this model's near-zero norm gradients into
    whole steps (1.4e-5 apart from one process at 4 ranks, with or without the options)."""
    return torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.5)


def _train(model: nn.Module, optimizer: Any, batches: Any, rank: int, world: int) -> None:
    """Steps as the entry point's users take them (Megatron-Core's loop for its adapter)."""
    for x, y in batches:
        x, y = local_slice(x, rank, world), local_slice(y, rank, world)
        if isinstance(model, MCoreFSDPModel):
            mcore_step(model, optimizer, nn.functional.mse_loss, x, y)
            continue
        nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()


def _gathered_bytes(units: list[Any], *, now: bool = True) -> int:
    """Bytes of unsharded (gathered, padded) weights the units hold now (or when gathered)."""
    total = 0
    for unit in units:
        for group in unit.groups:
            if group.model.sharded and (group.is_unsharded or not now):
                size = torch.empty((), dtype=group.compute_dtype).element_size()
                total += group.layout.padded_numel * size
    return total


_PER_MODULE_NAME = {
    "bucket_size": "max_bucket_numel",
    "suggested_communication_unit_size": "prefetch_numel",
}


def _wrap(how: dict[str, Any], world: int) -> tuple[nn.Module, nn.Module, torch.optim.Optimizer]:
    """The model to call, the user's module inside it, and its optimizer: the seed API
    (``{"fine": bool}``), or config fields (``{"config": {...}}``) through the reference's
    class, ``"entry": "mcore"`` or ``"entry": "per_module"``."""
    entry, shape = how.get("entry", "class"), how.get("shape", "wide")
    if "config" not in how:
        fine = how.get("fine", False)
        model = fully_shard_model(_model(), [Block], enable_fine_grained_param_gather=fine)
        return model, model.module, fully_shard_optimizer(_optimizer(model))
    if entry == "per_module":
        module = _model(shape)
        options = {_PER_MODULE_NAME[k]: v for k, v in how["config"].items()}
        options.update(how.get("per_module", {}))
        for block in [m for m in module if isinstance(m, Block)]:
            mfsdp_hooks.fully_shard(block, **options)
        mfsdp_hooks.fully_shard(module, **options)
        return module, module, _optimizer(module)
    if entry == "mcore":
        chunk = mcore_chunk(_model(shape), [Block], **how["config"])
        return chunk, chunk.module.module, _optimizer(chunk)
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp_shard",))
    config = DistributedDataParallelConfig(
        data_parallel_sharding_strategy="optim_grads_params",
        overlap_param_gather=True,  # the reference's default is off: nothing prefetched
        overlap_grad_reduce=True,
        **how["config"],
    )
    index = FSDPDistributedIndex(mesh, dp_shard_dim="dp_shard")
    model = MegatronFSDP(_model(shape), index, config, fsdp_unit_modules=[Block])
    return model, model.module, fully_shard_optimizer(_optimizer(model))


def _gather_worker(rank: int, world: int, how: dict[str, Any]) -> dict[str, Any]:
    model, inner, optimizer = _wrap(how, world)
    blocks = [m for m in inner.modules() if isinstance(m, Block)]
    in_blocks = [
        unit
        for unit in fsdp_units(model)
        if any(unit.module is m for b in blocks for m in b.modules())
    ]
    leaves = [m for b in blocks for m in b.modules() if next(m.children(), None) is None]
    peak = [0]

    def measure(module: nn.Module, args: Any) -> None:
        peak[0] = max(peak[0], _gathered_bytes(in_blocks))

    for leaf in leaves:  # after the engine's own pre-hook: the leaf's weights are gathered
        leaf.register_forward_pre_hook(measure)
    batches = _batches(world, how.get("shape", "wide"))
    _train(model, optimizer, batches[:1], rank, world)  # records the order
    peak[0] = 0
    with CommTracer() as tracer:
        _train(model, optimizer, batches[1:2], rank, world)
    _train(model, optimizer, batches[2:], rank, world)
    weights = {
        n.split("module.")[-1]: p.full_tensor().tolist() for n, p in model.named_parameters()
    }
    return {
        "peak": peak[0],
        "gathers": tracer.calls("all_gather"),
        "units": len(fsdp_units(model)),
        "largest_unit": max(_gathered_bytes([u], now=False) for u in in_blocks),
        "block": _gathered_bytes(in_blocks, now=False) // len(blocks),
        "weights": weights,
    }


@pytest.mark.parametrize(
    "world",
    [
        2,
        pytest.param(
            4, marks=pytest.mark.skipif(not FULL, reason="full matrix only: MFSDP_FULL_MATRIX=1")
        ),
    ],
)
def test_fine_grained_gathers_hold_two_leaves_not_two_blocks(world: int) -> None:
    coarse = run_distributed(_gather_worker, world, {"fine": False}, timeout=240)[0]
    fine_results = run_distributed(_gather_worker, world, {"fine": True}, timeout=240)
    fine = fine_results[0]
    # Whole blocks: the running block and the next one, prefetched.
    assert coarse["peak"] >= 2 * coarse["block"], coarse
    # Leaves: the running leaf and the next one at most.
    assert fine["peak"] <= 2 * fine["largest_unit"], fine
    # Here a block is two equal Linears and a norm: the peak about halves (two leaves ~ one
    # block, against two blocks).
    assert fine["peak"] < 0.55 * coarse["peak"], (fine["peak"], coarse["peak"])
    # One gather per leaf (3 blocks x 3 leaves, the head) instead of one per block.
    assert fine["units"] > coarse["units"] and fine["gathers"] > coarse["gathers"], (
        fine["gathers"],
        coarse["gathers"],
    )
    # The split changes nothing numerically: bit for bit the unit-wise run's weights.
    assert fine["weights"] == coarse["weights"]  # rank 0's, both
    _assert_parity(fine_results, world)


def _assert_parity(results: list[dict[str, Any]], world: int, shape: str = "wide") -> None:
    reference = _model(shape)
    _train(reference, _optimizer(reference), _batches(world, shape), 0, 1)
    for rank, result in enumerate(results):
        for name, param in reference.named_parameters():
            got = torch.tensor(result["weights"][name])
            assert_close_rel(got, param.detach(), 1e-5, f"rank {rank} {name}")


FC1_AND_NORM = (WIDTH * HIDDEN + HIDDEN) + 2 * WIDTH


ENTRIES = [
    "class",
    pytest.param("mcore", marks=pytest.mark.skipif(not FULL, reason="MFSDP_FULL_MATRIX=1 only")),
    "per_module",
]


@pytest.mark.parametrize("entry", ENTRIES)
def test_bucket_size_splits_each_units_gathers_without_changing_what_is_live(entry: str) -> None:
    """``ddp_config.bucket_size``: a block (norm, fc1, fc2) becomes two collectives."""
    whole = run_distributed(_gather_worker, 2, {"config": {}, "entry": entry}, timeout=240)[0]
    split = {"config": {"bucket_size": FC1_AND_NORM}, "entry": entry}
    results = run_distributed(_gather_worker, 2, split, timeout=240)
    bucketed = results[0]
    # 3 blocks x (forward + backward) gathers each doubled; the head's unit is one group.
    assert bucketed["gathers"] == whole["gathers"] + 6, (bucketed["gathers"], whole["gathers"])
    assert abs(bucketed["peak"] - whole["peak"]) <= 0.02 * whole["peak"], (bucketed, whole)
    _assert_parity(results, 2)


@pytest.mark.parametrize(
    ("blocks_ahead", "entry"),
    [
        (0, "class"),
        pytest.param(0, "mcore", marks=pytest.mark.skipif(not FULL, reason="full matrix only")),
        pytest.param(2, "class", marks=pytest.mark.skipif(not FULL, reason="full matrix only")),
        (2, "per_module"),
    ],
)
def test_suggested_communication_unit_size_bounds_what_is_gathered_ahead(
    blocks_ahead: int, entry: str
) -> None:
    """``ddp_config.suggested_communication_unit_size``: the elements gathered ahead; less
    than a block turns prefetching off, two blocks' worth gathers two blocks ahead."""
    block_numel = 2 * WIDTH + (WIDTH * HIDDEN + HIDDEN) + (HIDDEN * WIDTH + WIDTH)
    size = blocks_ahead * block_numel + (block_numel // 2 if blocks_ahead == 0 else 0)
    how = {"config": {"suggested_communication_unit_size": size}, "entry": entry}
    results = run_distributed(_gather_worker, 2, how, timeout=240)
    got = results[0]
    # At most the running block and the blocks ahead (the default prefetches one: two
    # blocks). The per-module API slides the window a unit at a time, so it is full at
    # every block; the config also merges the window into one all-gather, issued once it
    # has drained, so with the root unit first in line the blocks ahead peak at the window.
    full_window = (1 + blocks_ahead) * got["block"]
    lowest = full_window if entry == "per_module" else max(blocks_ahead, 1) * got["block"]
    assert lowest <= got["peak"] < full_window + got["block"], (got["peak"], got["block"])
    _assert_parity(results, 2)


def test_fine_grained_units_skip_tied_leaves_and_need_zero3() -> None:
    from mfsdp_hooks import ShardingStrategy, fine_grained_units
    from mfsdp_hooks.testing import make_model

    model = make_model()
    units = [*reversed(list(model.blocks)), model]
    order = fine_grained_units(model, units, ShardingStrategy.OPTIM_GRADS_PARAMS)
    names = {id(m): n for n, m in model.named_modules()}
    got = [names[id(m)] for m in order]
    # Each block's leaves before it; the root's untied leaves; the tied embed/head stay put.
    assert got[:4] == ["blocks.2.norm", "blocks.2.fc1", "blocks.2.fc2", "blocks.2"], got
    assert got[-3:] == ["frozen", "value", ""] and "embed" not in got and "head" not in got
    with pytest.raises(ValueError, match="zero_dp_strategy=3"):
        fine_grained_units(model, units, ShardingStrategy.OPTIM_GRADS)


SMALL_BLOCK = 2 * 16 + (16 * 32 + 32) + (32 * 16 + 16)  # a small block's elements
MERGE = 4  # suggested_communication_unit_size: four small blocks


@pytest.mark.parametrize(
    "entry",
    [
        "class",
        pytest.param("mcore", marks=pytest.mark.skipif(not FULL, reason="full matrix only")),
        pytest.param("per_module", marks=pytest.mark.skipif(not FULL, reason="full matrix only")),
    ],
)
def test_small_units_are_gathered_four_to_a_collective(entry: str) -> None:
    """``suggested_communication_unit_size`` of four small blocks: the blocks gathered ahead
    go out four to an all-gather, against one each with the same window unmerged."""
    window = {"suggested_communication_unit_size": MERGE * SMALL_BLOCK}
    merged = {"config": window, "entry": entry, "shape": "small"}
    if entry == "per_module":
        merged["per_module"] = {"coalesce_prefetch": True}
    results = run_distributed(_gather_worker, 2, merged, timeout=240)
    got = results[0]
    unmerged = {"config": window, "entry": "per_module", "shape": "small"}
    one_by_one = run_distributed(_gather_worker, 2, unmerged, timeout=240)[0]
    blocks = SHAPES["small"][0]
    # Unmerged: forward gathers the root and each block, backward each block again (all
    # were resharded after forward): one collective per unit.
    assert one_by_one["gathers"] == (1 + blocks) + blocks, one_by_one["gathers"]
    # Merged: forward the root, then the blocks four at a time; backward the last block
    # alone (its pre-backward), then the other 31 four at a time.
    merged_count = (1 + blocks // MERGE) + (1 + math.ceil((blocks - 1) / MERGE))
    assert got["gathers"] == merged_count, got["gathers"]
    # What is live is the same window: the running block and the four gathered ahead.
    assert got["peak"] == one_by_one["peak"] <= (1 + MERGE) * got["block"], (got, one_by_one)
    assert got["weights"] == one_by_one["weights"]  # the same steps, bit for bit
    _assert_parity(results, 2, "small")
