"""torchao float8 weights sharded by the engine train as one-process float8 training.

The reference runs each rank's share of the batch as a micro-batch of its own
(``float8_step``): float8 scales activations per tensor, so a whole-batch reference would
quantise them differently.

Every ``Float8Linear`` weight (``enable_fsdp_float8_all_gather=True``) travels as float8
bytes and comes back as the ``Float8TrainingTensor`` the float8 matmul uses; the LayerNorm
and the high-precision head share the units (mixed groups). Runs on CPU (torch's
``_scaled_mm``), so this is the FP8 path CI tests.
"""

from __future__ import annotations

import os

import pytest
import torch
from torch import nn

pytest.importorskip("torchao.float8", reason="torchao is not installed (nox installs it)")

from mfsdp_collectives.testing import run_distributed
from mfsdp_hooks import fully_shard
from mfsdp_te import float8_codecs
from mfsdp_te.float8_testing import float8_batch, float8_model, float8_step

STEPS = 10


def _shard(model: nn.Module, strategy: int) -> nn.Module:
    for block in model.blocks:  # type: ignore[union-attr]
        fully_shard(block, sharding_strategy=strategy, param_codecs=float8_codecs())
    return fully_shard(model, sharding_strategy=strategy, param_codecs=float8_codecs())


def _parity_worker(rank: int, world: int, strategy: int, rowwise: bool = False) -> list[float]:
    reference = float8_model(rowwise=rowwise)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    model = _shard(float8_model(rowwise=rowwise), strategy)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    errors = []
    for step in range(STEPS):
        got = float8_step(model, optimizer, step, world, sharded=True)
        want = float8_step(reference, ref_opt, step, world, sharded=False)
        errors.append(abs(got - want) / abs(want))
    for name, param in model.named_parameters():
        want_param = reference.get_parameter(name)
        torch.testing.assert_close(param.full_tensor(), want_param.detach(), rtol=1e-5, atol=1e-6)
    return errors


FULL_ONLY = pytest.mark.skipif(
    os.environ.get("MFSDP_FULL_MATRIX") != "1",
    reason="MFSDP_FULL_MATRIX=1 (nox -s tests_full) runs it",
)


@pytest.mark.parametrize(
    ("world", "strategy"),
    # 4 ranks: also covered by the float8 checkpoint and HFSDP float8 tests in CI
    [(2, 3), pytest.param(4, 3, marks=FULL_ONLY), (2, 2), (2, 1), (2, 0)],
)
def test_float8_training_matches_one_process_float8_training(world: int, strategy: int) -> None:
    for errors in run_distributed(_parity_worker, world, strategy, timeout=240):
        assert max(errors) <= 1e-5, errors


def test_rowwise_float8_training_matches_one_process_training() -> None:
    # Rowwise scaling has no float8 all-gather in torchao: plain weights, float8 matmuls.
    for errors in run_distributed(_parity_worker, 2, 3, True, timeout=240):
        assert max(errors) <= 1e-5, errors


def _gather_bytes_worker(rank: int, world: int, float8: bool) -> dict[str, int]:
    """Bytes this rank sends into the blocks' all-gathers of one forward, by dtype."""
    from mfsdp_collectives import CommTracer
    from mfsdp_hooks import fsdp_units

    model = _shard(float8_model(float8_all_gather=float8), 3)
    x, _ = float8_batch(0)
    model(x.chunk(world)[rank])  # the first forward records the order; measure the second
    with CommTracer() as tracer:
        model(x.chunk(world)[rank])
    sent: dict[str, int] = {}
    for record in tracer.records:
        if record.op == "all_gather":
            sent[str(record.dtype)] = sent.get(str(record.dtype), 0) + record.bytes
    blocks = [g for b in model.blocks for u in fsdp_units(b)[:1] for g in u.groups]  # type: ignore[union-attr]
    wire = [g for g in blocks if g.model.dtype == torch.uint8]
    sent["float8 groups' shards"] = sum(g.layout.shard_numel for g in wire)
    sent["float8 groups' padding"] = sum(g.layout.padded_numel - g.layout.data_numel for g in wire)
    sent["float8 weights"] = sum(
        b.up.weight.numel() + b.down.weight.numel()  # type: ignore[union-attr]
        for b in model.blocks  # type: ignore[union-attr]
    )
    sent["float8 groups' elements"] = sum(g.layout.data_numel for g in wire)
    return sent


def test_float8_weights_travel_as_one_byte_per_element() -> None:
    for float8, plain in zip(
        run_distributed(_gather_bytes_worker, 2, True, timeout=120),
        run_distributed(_gather_bytes_worker, 2, False, timeout=120),
        strict=True,
    ):
        # Each block's float8 weights (and only they) travel in a uint8 group of their own:
        # one byte per element, gathered once per forward.
        assert float8["float8 groups' elements"] == float8["float8 weights"]
        assert float8["torch.uint8"] == float8["float8 groups' shards"]
        assert "torch.uint8" not in plain
        # The same weights as fp32 cost 4 bytes per element: 3 saved per element.
        saved = plain["torch.float32"] - float8["torch.float32"] - float8["torch.uint8"]
        shards = float8["float8 groups' shards"]
        assert abs(saved - 3 * shards) <= 4 * float8["float8 groups' padding"], (float8, plain)
