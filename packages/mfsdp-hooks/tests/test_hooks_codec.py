"""The ``ParamCodec`` extension point carries the weights of every all-gather and install.

A codec that sends twice the weight and halves the gathered buffer is exact in binary
floating point, so training with it must match training without it bit for bit, while its
counters prove both ends ran: if the engine skipped ``decode`` the weights would double, if
it skipped ``encode`` they would halve.
"""

from __future__ import annotations

import pytest
import torch
from hooks_models import Block, make_batches, make_model, train_data_parallel, trainable

from mfsdp_collectives.testing import run_distributed
from mfsdp_hooks import (
    FSDPRootWrapper,
    MixedPrecisionPolicy,
    ShardingOptions,
    attach_optimizer,
    fully_shard,
)

BF16 = MixedPrecisionPolicy(param_dtype=torch.bfloat16)


class DoublingCodec:
    """Sends 2x the weight, halves what arrives."""

    decodes = True

    def __init__(self) -> None:
        self.encoded = 0
        self.decoded = 0

    def encode(self, source: torch.Tensor, out: torch.Tensor) -> None:
        self.encoded += 1
        torch.mul(source, 2.0, out=out)

    def decode(self, gathered: torch.Tensor) -> None:
        self.decoded += 1
        gathered.mul_(0.5)


def _train(rank: int, world: int, strategy: int, codec: DoublingCodec | None) -> list[float]:
    options = ShardingOptions(
        zero_dp_strategy=strategy,
        mixed_precision_policy=BF16,
        param_codec=codec,
        sync_model_each_microbatch=False,
    )
    model = FSDPRootWrapper(make_model(), fsdp_unit_modules=[Block], options=options)
    optimizer = attach_optimizer(torch.optim.AdamW(trainable(model), lr=1e-2))
    return train_data_parallel(model, optimizer, make_batches(10, 4), rank, world)


def _codec_world(rank: int, world: int, strategy: int) -> dict[str, object]:
    codec = DoublingCodec()
    return {
        "plain": _train(rank, world, strategy, None),
        "coded": _train(rank, world, strategy, codec),
        "encoded": codec.encoded,
        "decoded": codec.decoded,
    }


@pytest.mark.parametrize("strategy", [0, 1, 3])
def test_a_codec_carries_every_gather_and_install_exactly(strategy: int) -> None:
    for out in run_distributed(_codec_world, 2, strategy, timeout=120):
        assert out["coded"] == out["plain"], out
        assert isinstance(out["encoded"], int) and out["encoded"] >= 10, out
        assert out["decoded"] == out["encoded"], out


def _without_main_weights(rank: int, world: int) -> str:
    try:
        fully_shard(make_model(), param_codec=DoublingCodec())
    except NotImplementedError as error:
        return str(error)
    return "accepted"


def test_a_codec_without_separate_main_weights_is_refused() -> None:
    for message in run_distributed(_without_main_weights, 2, timeout=60):
        assert message.startswith("param_codec=DoublingCodec for "), message
        assert "MixedPrecisionPolicy whose param_dtype differs" in message, message
