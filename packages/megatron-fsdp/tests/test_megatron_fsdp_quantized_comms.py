"""``quantize_communication`` through every entry point (the matrix's rows: the seed API,
``fully_shard_model``, the ``MegatronFSDP`` class, the per-module API and the Megatron-Core
adapter), 2 gloo ranks, the toy model (tied head, frozen layer) under ZeRO-3: every unit the
entry point made gets the quantized comms, they run, and the losses follow one-process
training within 1% over the matrix's 10 steps; the same with the matrix's other columns
(HSDP, TP, EP, CP, bf16, no_sync, recompute, offload, ...); where they cannot be honoured
(float8 weights, the only copy of ZeRO-1/2 fp32 weights) they are refused by name, and a
lossy custom gather never replaces the weights the optimizer steps."""

from __future__ import annotations

import functools
import os
from typing import Any

import pytest
import torch
import torch.distributed as dist
from matrix_cases import ROWS, STEPS, build, make_layout, reference_run, train_step, world_size
from torch.distributed.tensor import DTensor

import mfsdp_hooks
from mfsdp_collectives import BlockQuantization, QuantizedAllGather, QuantizedReduceScatter
from mfsdp_collectives.testing import run_distributed
from mfsdp_collectives.testing.counting_comms import CountingAllGather

FULL = os.environ.get("MFSDP_FULL_MATRIX") == "1"
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


class _Bf16Gather(CountingAllGather):
    """A lossy all-gather comm (bf16 on the wire, as low-precision gather hooks do): every
    slot, this rank's too, comes back rounded to bf16."""

    def __call__(self, output_tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        kwargs["async_op"] = False
        super().__call__(output_tensor, *args, **kwargs)
        output_tensor.copy_(output_tensor.to(torch.bfloat16))
        return None


def _off_the_bf16_grid(optimizer: torch.optim.Optimizer) -> list[bool]:
    """Per parameter the optimizer steps: whether any of this rank's values is not a bf16."""
    found = []
    for group in optimizer.param_groups:
        for param in group["params"]:
            local = param.to_local() if isinstance(param, DTensor) else param
            values = local.detach().float()
            if values.numel() >= 8:  # this rank holds some of it (ZeRO shards them)
                found.append(bool((values != values.to(torch.bfloat16).float()).any()))
    return found


def _lossy_gather_zero2(rank: int, world: int, row: str) -> dict[str, Any]:
    layout = make_layout("zero2", rank, world)
    built = build(row, "zero2", layout)
    units = [m for m in built.model.modules() if isinstance(m, mfsdp_hooks.FSDPModule)]
    with pytest.raises(ValueError) as refused:
        mfsdp_hooks.quantize_communication(built.model, gradients=None, weights=SPEC)
    untouched = all(mfsdp_hooks.fsdp_units(u)[0].comm_hooks.all_gather is None for u in units)
    comm = _Bf16Gather()
    for unit in units:
        unit.set_custom_all_gather(comm)
    losses = [train_step(built, row, "zero2", step, layout) for step in range(STEPS)]
    dist.barrier()
    return {
        "refused": str(refused.value),
        "untouched": untouched,
        "gathers": comm.calls,
        "off_grid": _off_the_bf16_grid(built.optimizer),
        "losses": losses,
    }


@pytest.mark.parametrize("row", ["seed", "model_optimizer", "class", "per_module", "mcore"])
def test_a_lossy_gather_leaves_the_weights_the_zero2_optimizer_steps(row: str) -> None:
    """ZeRO-1/2 in fp32 keep one copy of each rank's weights: its slot of the gathered
    buffer. A custom comm's version of that slot (here bf16) must not replace it, or the
    optimizer would step rounded weights from then on; quantized weights, which would make
    the ranks' weights differ, are refused there by name before any unit changes."""
    want = reference_run(row, "zero2")["losses"]
    for result in run_distributed(_lossy_gather_zero2, 2, row, timeout=120):
        assert "keeps its weights whole" in result["refused"], result["refused"]
        assert "zero_dp_strategy='optim_grads_params'" in result["refused"]
        assert result["untouched"]
        assert result["gathers"] >= STEPS
        # fp32 weights stay fp32 through the gathers: none is rounded to bf16
        assert result["off_grid"] and all(result["off_grid"]), result["off_grid"]
        for got, exact in zip(result["losses"], want, strict=True):
            assert abs(got - exact) <= 0.01 * abs(exact), (row, got, exact)


def _float8_weights(rank: int, world: int, row: str) -> dict[str, Any]:
    layout = make_layout("float8", rank, world)
    built = build(row, "float8", layout)
    units = [m for m in built.model.modules() if isinstance(m, mfsdp_hooks.FSDPModule)]
    with pytest.raises(ValueError) as refused:
        mfsdp_hooks.quantize_communication(built.model, weights=SPEC)
    hooks = [mfsdp_hooks.fsdp_units(u)[0].comm_hooks for u in units]
    return {
        "refused": str(refused.value),
        "untouched": all(h.all_gather is None and h.reduce_scatter is None for h in hooks),
    }


_FULL_ONLY = pytest.mark.skip(reason="CI cross-section: MFSDP_FULL_MATRIX=1 (nox -s tests_full)")


@pytest.mark.parametrize(
    "row",
    [
        pytest.param(
            row, marks=() if FULL or row in ("model_optimizer", "per_module") else _FULL_ONLY
        )
        for row in ROWS
    ],
)
def test_float8_weights_are_not_block_quantized(row: str) -> None:
    """float8 weights travel as bytes: rounding a byte as a number makes another float8 value
    (or a NaN), so quantized weights are refused for them by name, before any unit changes."""
    pytest.importorskip("torchao")
    for result in run_distributed(_float8_weights, 2, row, timeout=120):
        assert "gathers its weights as torch.uint8" in result["refused"], result["refused"]
        assert result["untouched"]


# The matrix's columns that take custom comms (HFSDP and no_shard refuse them; ZeRO-1/2 refuse
# quantized weights, above), with quantized gradients and weights on every unit.
COMPOSED = (
    "hsdp",
    "tp_dtensor",
    "ep",
    "cp",
    "bf16",
    "no_sync",
    "recompute",
    "cpu_offload",
    "decoupled_grad",
    "fine_grained",
    "meta_init",
    "to_device",
    "train_eval",
    "tied",
    "frozen",
    "reshard_int",
)
IN_CI = {"hsdp", "bf16", "no_sync"}


def _composed(rank: int, world: int, row: str, col: str) -> list[float]:
    layout = make_layout(col, rank, world)
    built = build(row, col, layout)
    mfsdp_hooks.quantize_communication(built.model, gradients=SPEC, weights=SPEC)
    losses = [train_step(built, row, col, step, layout) for step in range(STEPS)]
    dist.barrier()
    return losses


def _composed_cases() -> list[Any]:
    """Two rows for every column; all five for ``reshard_int``, whose backward gather over
    pairs each entry point reaches through its own option (``reshard_after_forward=2``,
    ``reshard_after_forward_group_size=2``)."""
    return [
        pytest.param(
            row, col, marks=() if FULL or (col in IN_CI and row == "per_module") else _FULL_ONLY
        )
        for row in ROWS
        for col in COMPOSED
        if row in ("per_module", "model_optimizer") or col == "reshard_int"
        if not (row == "model_optimizer" and col in ("cpu_offload", "fine_grained"))
    ]


@pytest.mark.parametrize(("row", "col"), _composed_cases())
def test_quantized_comms_compose_with_the_matrix_columns(row: str, col: str) -> None:
    want = reference_run(row, col)["losses"]
    for losses in run_distributed(_composed, world_size(col), row, col, timeout=120):
        for got, exact in zip(losses, want, strict=True):
            assert abs(got - exact) <= 0.01 * abs(exact), (row, col, got, exact)
