"""The engine's toy model (from ``mfsdp_hooks.testing``) and the checkpoint tests' loop.

Tied embedding/head, a frozen layer, odd 7x15 shapes cut unevenly over 2, 3 and 4 ranks.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from mfsdp_hooks import FSDPRootWrapper, ShardingOptions, fully_shard
from mfsdp_hooks.testing import (
    WIDTH,
    Block,
    ToyModel,
    local_slice,
    loss_fn,
    make_batches,
    make_model,
    train_data_parallel,
    train_single_process,
)

GLOBAL_BATCH = 12  # divisible by 1, 2, 3 and 4

__all__ = [
    "GLOBAL_BATCH",
    "WIDTH",
    "Block",
    "ToyModel",
    "assert_rel",
    "assert_states_equal",
    "local_slice",
    "loss_fn",
    "make_batches",
    "make_model",
    "make_optimizer",
    "pack",
    "reference_train",
    "shard",
    "train",
    "unpack",
]


def make_optimizer(model: nn.Module) -> torch.optim.Optimizer:
    params = [p for p in model.parameters() if p.requires_grad]
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)


def shard(model: nn.Module, strategy: int, api: str = "megatron", **options: Any) -> nn.Module:
    """Shard ``model`` with the wrapper (names get ``module.``) or per module (names kept).
    ``options`` are ``fully_shard``'s keywords; the wrapper takes ``mp_policy`` of them."""
    if api == "megatron":
        policy = options.pop("mp_policy", None)
        if options:
            raise TypeError(f"shard(api='megatron') takes mp_policy only, got {sorted(options)}")
        record = ShardingOptions(
            zero_dp_strategy=strategy,
            sync_model_each_microbatch=True,
            mixed_precision_policy=policy,
        )
        return FSDPRootWrapper(model, fsdp_unit_modules=[Block], options=record)
    for block in model.blocks:  # type: ignore[union-attr]
        fully_shard(block, sharding_strategy=strategy, **options)
    return fully_shard(model, sharding_strategy=strategy, **options)


def train(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    batches: list[Any],
    rank: int,
    world: int,
) -> list[float]:
    """Data-parallel steps on the global batch; returns the global mean loss of each step."""
    return train_data_parallel(model, optimizer, batches, rank, world, global_mean=True)


def reference_train(batches: list[Any], model_fn: Callable[[], nn.Module] = make_model) -> Any:
    model = model_fn()
    optimizer = make_optimizer(model)
    return model, optimizer, train_single_process(model, optimizer, batches)


def assert_rel(got: list[float], want: list[float], rtol: float, what: str) -> None:
    assert len(got) == len(want), f"{what}: {len(got)} values vs {len(want)}"
    for step, (a, b) in enumerate(zip(got, want, strict=True)):
        assert abs(a - b) <= rtol * abs(b), f"{what} step {step}: {a!r} vs {b!r} (rtol {rtol})"


def assert_states_equal(
    got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], what: str, rtol: float = 0.0
) -> None:
    assert sorted(got) == sorted(want), f"{what}: keys {sorted(got)} != {sorted(want)}"
    for key, value in want.items():
        other = got[key]
        assert other.shape == value.shape and other.dtype == value.dtype, f"{what}: {key}"
        if rtol == 0.0:
            assert torch.equal(other, value), f"{what}: {key} differs"
        else:
            torch.testing.assert_close(other, value, rtol=rtol, atol=rtol, msg=f"{what}: {key}")


def pack(value: Any) -> bytes:
    """Tensors cannot leave a rank as tensors (they travel as shared memory that dies with the
    rank); ship them as ``torch.save`` bytes instead."""
    import io

    buffer = io.BytesIO()
    torch.save(value, buffer)
    return buffer.getvalue()


def unpack(blob: bytes) -> Any:
    import io

    return torch.load(io.BytesIO(blob), weights_only=False)
