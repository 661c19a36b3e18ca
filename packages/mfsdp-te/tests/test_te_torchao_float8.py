"""torchao float8 weights sharded by the engine train as one-process float8 training.

The reference runs each rank's share of the batch as a micro-batch of its own
(``reference_shares``): float8 scales activations per tensor, so a whole-batch reference would
quantise them differently.

Every ``Float8Linear`` weight (``enable_fsdp_float8_all_gather=True``) travels as float8
bytes and comes back as the ``Float8TrainingTensor`` the float8 matmul uses; the LayerNorm
and the high-precision head share the units (mixed groups). Runs on CPU (torch's
``_scaled_mm``), so this is the FP8 path CI tests.
"""

from __future__ import annotations

import os
from functools import partial

import pytest
import torch
from torch import nn

pytest.importorskip("torchao.float8", reason="torchao is not installed (nox installs it)")

from mfsdp_collectives.testing import run_distributed
from mfsdp_hooks.testing.parity import ParityCase, run_parity, shard_blocks
from mfsdp_te import float8_codecs
from mfsdp_te.float8_testing import float8_batch, float8_model


def _shard(model: nn.Module, strategy: int) -> nn.Module:
    return shard_blocks(model, sharding_strategy=strategy, param_codecs=float8_codecs())


def _float8_batches(n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [float8_batch(step) for step in range(n)]


def _float8_case(strategy: int, rowwise: bool = False) -> ParityCase:
    return ParityCase(
        f"strategy={strategy} rowwise={rowwise}",
        partial(_shard, strategy=strategy),
        model=partial(float8_model, rowwise=rowwise),
        batches=_float8_batches,
        loss=nn.functional.mse_loss,
        reference_shares=True,
    )


FULL_ONLY = pytest.mark.skipif(
    os.environ.get("MFSDP_FULL_MATRIX") != "1",
    reason="MFSDP_FULL_MATRIX=1 (nox -s tests_full) runs it",
)


@pytest.mark.parametrize(
    ("world", "layouts"),  # (strategy, rowwise)
    [
        # Rowwise scaling has no float8 all-gather in torchao: plain weights, float8 matmuls.
        pytest.param(2, [(1, False), (0, False), (3, True)], id="2"),
        # ZeRO-2/3 at 2 ranks, and 4 ranks: also covered by the float8 checkpoint and HFSDP
        # float8 tests in CI
        pytest.param(2, [(3, False), (2, False)], marks=FULL_ONLY, id="2-zero23"),
        pytest.param(4, [(3, False)], marks=FULL_ONLY, id="4"),
    ],
)
def test_float8_training_matches_one_process_float8_training(
    world: int, layouts: list[tuple[int, bool]]
) -> None:
    run_parity(world, [_float8_case(strategy, rowwise) for strategy, rowwise in layouts])


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
