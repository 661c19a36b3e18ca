"""``quantize_communication`` through every entry point (the matrix's rows: the seed API,
``fully_shard_model``, the ``MegatronFSDP`` class, the per-module API and the Megatron-Core
adapter), 2 gloo ranks, the toy model (tied head, frozen layer) under ZeRO-3: every unit the
entry point made gets the quantized comms, they run, and the losses follow one-process
training within 1% over the matrix's 10 steps."""

from __future__ import annotations

import functools
from typing import Any

import pytest
import torch.distributed as dist
from matrix_cases import ROWS, STEPS, build, make_layout, reference_run, train_step

import mfsdp_hooks
from mfsdp_collectives import BlockQuantization, QuantizedAllGather, QuantizedReduceScatter
from mfsdp_collectives.testing import run_distributed

# Small blocks: the toy model's chunks are small (one under a block stays full precision).
SPEC = BlockQuantization(bits=8, block=16)


def _worker(rank: int, world: int, row: str) -> dict[str, Any]:
    layout = make_layout("zero3", rank, world)
    built = build(row, "zero3", layout)
    units = mfsdp_hooks.quantize_communication(built.model, gradients=SPEC, weights=SPEC)
    for unit in units:
        hooks = mfsdp_hooks.fsdp_units(unit)[0].comm_hooks
        assert isinstance(hooks.reduce_scatter, QuantizedReduceScatter)
        assert isinstance(hooks.all_gather, QuantizedAllGather)
    made = [m for m in built.model.modules() if isinstance(m, mfsdp_hooks.FSDPModule)]
    losses = [train_step(built, row, "zero3", step, layout) for step in range(STEPS)]
    dist.barrier()
    return {"units": (len(units), len(made)), "losses": losses}


@functools.cache
def _reference(row: str) -> list[float]:
    losses: list[float] = reference_run(row, "zero3")["losses"]
    return losses


@pytest.mark.parametrize("row", ROWS)
def test_quantize_communication_reaches_every_entry_points_units(row: str) -> None:
    want = _reference(row)
    for result in run_distributed(_worker, 2, row, timeout=120):
        count, made = result["units"]
        assert count == made > 0
        for step, (got, exact) in enumerate(zip(result["losses"], want, strict=True)):
            assert abs(got - exact) <= 0.01 * abs(exact), (row, step, got, exact)
        assert result["losses"] != want  # quantized, not exact
