"""``mixed_precision_context(policy)``: another mixed-precision policy for a region, through
every entry point (the seed one-liner, fully_shard_model, the class API, the per-module root,
the Megatron-Core adapter), on 2 ranks after 3 training steps.

* bf16 evaluation of the fp32-trained model (``param_dtype=bfloat16`` under ``no_grad``):
  outputs bit-identical to the gathered weights cast to bf16 in one process, in bf16;
  a forward with autograd on inside such a region raises; after the region, fp32 outputs and
  training are as if it never happened (parity with one process to 1e-5 over 10 steps).
* the reference's switch, ``reduce_dtype`` (its ``grad_comm_dtype``): a step inside
  ``reduce_dtype=bfloat16`` reduce-scatters half the bytes of a step outside it.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import pytest
import torch
from matrix_cases import (
    ROWS,
    STEPS,
    assert_parity,
    build,
    final_weights,
    local_share,
    make_layout,
    reference_run,
    train_step,
)

from mfsdp_collectives import CommTracer
from mfsdp_collectives.testing import run_distributed
from mfsdp_hooks import MixedPrecisionPolicy, fsdp_units
from mfsdp_hooks.testing import ToyModel, make_batches

COL = "zero3"
BF16 = torch.bfloat16


def _region_target(built: Any, row: str) -> Any:
    """What the user calls ``mixed_precision_context`` on for the row's entry point."""
    return built.model if row != "per_module" else built.inner


def _plain_copy(weights: dict[str, torch.Tensor]) -> ToyModel:
    model = ToyModel()
    model.load_state_dict(weights, strict=False)  # the tied head comes with the embedding
    return model


def _region_worker(rank: int, world: int, row: str) -> dict[str, Any]:
    layout = make_layout(COL, rank, world)
    built = build(row, COL, layout)
    target = _region_target(built, row)
    losses = [train_step(built, row, COL, step, layout) for step in range(3)]
    x, _ = local_share(*make_batches(1, global_batch=12, seq=5, seed=7)[0], layout)
    trained = _plain_copy(final_weights(built, COL, layout))
    policy = target.mixed_precision_policy
    with target.mixed_precision_context(dataclasses.replace(policy, param_dtype=BF16)):
        with torch.no_grad():
            logits, value = built.model(x)
        with pytest.raises(RuntimeError, match=r"autograd on inside mixed_precision_context"):
            built.model(x)
    assert logits.dtype == BF16 and value.dtype == BF16
    with torch.no_grad():
        want_logits, want_value = trained.bfloat16()(x)
    assert torch.equal(logits, want_logits) and torch.equal(value, want_value)
    with torch.no_grad():  # after the region: the trained weights in fp32 again
        logits32, _ = built.model(x)
        assert logits32.dtype == torch.float32
        assert torch.equal(logits32, _plain_copy(final_weights(built, COL, layout))(x)[0])
    losses += [train_step(built, row, COL, step, layout) for step in range(3, STEPS)]
    weights = {k: v.tolist() for k, v in final_weights(built, COL, layout).items()}
    # The reference's switch: the gradient reduction in bf16 for one more step.
    with CommTracer() as outside:
        train_step(built, row, COL, 0, layout)
    cheaper = dataclasses.replace(policy, reduce_dtype=BF16)
    with target.mixed_precision_context(cheaper), CommTracer() as inside:
        # what the groups report is the region's dtype, and the policy's again after it
        assert _reduce_dtypes(built.model) == {BF16}
        train_step(built, row, COL, 1, layout)
    assert _reduce_dtypes(built.model) == {torch.float32}
    with CommTracer() as after:
        train_step(built, row, COL, 2, layout)
    reduced = [t.bytes("reduce_scatter") for t in (outside, inside, after)]
    return {"losses": losses, "evals": [], "weights": weights, "reduced": reduced}


def _reduce_dtypes(model: Any) -> set[torch.dtype]:
    return {g.reduce_dtype for u in fsdp_units(model) for g in u.groups if g.requires_grad}


FULL = os.environ.get("MFSDP_FULL_MATRIX") == "1"


CI_ROWS = ("seed",)  # plain pytest; MFSDP_FULL_MATRIX=1 runs every row at 2 and 4


def _cases() -> list[Any]:
    full_only = pytest.mark.skip(reason="full matrix only: MFSDP_FULL_MATRIX=1")
    return [
        pytest.param(
            row, world, marks=[] if FULL or (world == 2 and row in CI_ROWS) else [full_only]
        )
        for row in ROWS
        for world in (2, 4)
    ]


@pytest.mark.parametrize(("row", "world"), _cases())
def test_mixed_precision_context_through_every_entry_point(row: str, world: int) -> None:
    results = run_distributed(_region_worker, world, row, timeout=240)
    want = reference_run(row, COL)
    for rank, result in enumerate(results):
        assert_parity(result, want, COL, 1e-5, f"{row} rank {rank}")
        outside, inside, after = result["reduced"]
        assert outside > 0 and inside * 2 == outside and after == outside, result["reduced"]


def _refusals_worker(rank: int, world: int) -> None:
    from megatron_fsdp import fully_shard_model
    from mfsdp_hooks.testing import Block, loss_fn, make_model

    bf16 = MixedPrecisionPolicy(param_dtype=BF16, reduce_dtype=torch.float32)
    model = fully_shard_model(make_model(), [Block], mixed_precision_policy=bf16)
    tokens, targets = make_batches(1, global_batch=4, seq=5)[0]
    fp32 = dataclasses.replace(bf16, param_dtype=torch.float32)
    # bf16 compute weights from fp32 main weights: an fp32 region would round them twice.
    with pytest.raises(NotImplementedError, match="round them twice"):
        _enter(model, fp32)
    with pytest.raises(ValueError, match="main_params_dtype"):
        _enter(model, dataclasses.replace(bf16, main_params_dtype=None))
    with pytest.raises(TypeError, match="policy must be"):
        _enter(model, "bf16")
    cheaper = dataclasses.replace(bf16, reduce_dtype=BF16)
    with model.mixed_precision_context(cheaper), pytest.raises(RuntimeError, match="nest"):
        _enter(model, cheaper)
    loss = loss_fn(model(tokens), targets)  # mid-step: a forward whose backward is pending
    with pytest.raises(RuntimeError, match="between steps"):
        _enter(model, cheaper)
    loss.backward()
    assert model.mixed_precision_policy == bf16  # every refusal left the model as it was


def _enter(model: Any, policy: Any) -> None:
    with model.mixed_precision_context(policy):
        pass


def test_mixed_precision_context_refuses_what_it_cannot_do_and_leaves_the_model_as_it_was() -> None:
    run_distributed(_refusals_worker, 2, timeout=120)
