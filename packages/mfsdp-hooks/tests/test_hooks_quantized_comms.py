"""Block-quantized collectives in training, through FSDP2's comm hooks
(``QuantizedReduceScatter``, ``QuantizedAllGather`` on every unit, 2 gloo ranks): the losses
follow full precision's within 1% over 10 steps while the gradients travel in about a quarter
of the bytes, and an inf gradient on one rank is reported on every rank naming the parameter."""

from __future__ import annotations

from typing import Any

import pytest
from hooks_models import AlignedModel, shard_blocks_then_root, train_aligned

from mfsdp_collectives import (
    BlockQuantization,
    C10dTracer,
    QuantizedAllGather,
    QuantizedReduceScatter,
)
from mfsdp_collectives.testing import run_distributed
from mfsdp_hooks import FSDPModule, quantize_communication

STEPS = 10
SPEC = BlockQuantization(bits=8, block=256)


def _train(rank: int, world: int, quantized: bool, poison: bool = False) -> dict[str, Any]:
    model = AlignedModel()
    shard_blocks_then_root(model, "ours", host_transport="gloo")
    if quantized and poison:  # the one-call opt-in
        quantize_communication(model, gradients=SPEC, weights=SPEC)
    elif quantized:  # the per-unit hooks it sets
        for unit in model.modules():
            if isinstance(unit, FSDPModule):
                unit.set_custom_reduce_scatter(QuantizedReduceScatter(SPEC))
                unit.set_custom_all_gather(QuantizedAllGather(SPEC))
    with C10dTracer() as log:
        losses = train_aligned(model, rank, STEPS, poison_rank=1 if poison else None)
    summary = log.summary()
    return {
        "losses": losses,
        # what went on the wire: full-precision reduce-scatters and quantized all-to-alls
        "rs_bytes": sum(
            v["bytes"] for k, v in summary.items() if k.endswith(("/reduce_scatter", "/all_to_all"))
        ),
    }


def test_quantized_training_follows_full_precision_with_a_quarter_of_the_bytes() -> None:
    full = run_distributed(_train, 2, False, timeout=120)
    quantized = run_distributed(_train, 2, True, timeout=120)
    for exact, approx in zip(full, quantized, strict=True):
        for a, b in zip(exact["losses"], approx["losses"], strict=True):
            assert abs(a - b) <= 0.01 * abs(a), (a, b)
        assert exact["losses"] != approx["losses"]  # the comms did quantize
        # the root's small group (the head, 256 elements a rank) stays full precision
        assert approx["rs_bytes"] <= 0.3 * exact["rs_bytes"], (approx, exact)


def _poisoned(rank: int, world: int) -> str:
    with pytest.raises(FloatingPointError) as caught:
        _train(rank, world, True, poison=True)
    return str(caught.value)


def test_an_inf_gradient_is_reported_on_every_rank_naming_the_parameter() -> None:
    for message in run_distributed(_poisoned, 2, timeout=120):
        assert "holds a non-finite value on rank 1" in message, message
        assert "the gradient of " in message and ".weight" in message, message


def test_quantize_communication_refuses_an_unwrapped_model_and_a_bad_setting() -> None:
    with pytest.raises(ValueError, match="holds no fully-sharded unit"):
        quantize_communication(AlignedModel())
    with pytest.raises(TypeError, match=r"gradients must be a mfsdp_collectives\.BlockQ"):
        quantize_communication(AlignedModel(), gradients=8)  # type: ignore[arg-type]
