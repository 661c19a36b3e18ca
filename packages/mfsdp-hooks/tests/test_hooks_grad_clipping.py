"""torch.nn.utils.clip_grad_norm_ over the sharded gradients: the global norm, and parity."""

from __future__ import annotations

import pytest
import torch
from hooks_models import (
    assert_close_rel,
    full_state,
    local_slice,
    loss_fn,
    make_batches,
    make_model,
    make_optimizer,
    trainable,
)
from torch.distributed.tensor import DTensor

from mfsdp_collectives.testing import run_distributed
from mfsdp_hooks.testing.parity import shard_blocks

MAX_NORM = 0.05


def _clipping_worker(rank: int, world: int, strategy: int) -> list[float]:
    batches = make_batches(4, 8)
    reference = make_model()
    ref_opt = make_optimizer("adamw", trainable(reference))
    model = make_model()
    shard_blocks(model, sharding_strategy=strategy)
    optimizer = make_optimizer("adamw", trainable(model))
    norms = []
    for tokens, targets in batches:
        loss_fn(reference(tokens), targets).backward()
        expected = torch.nn.utils.clip_grad_norm_(trainable(reference), MAX_NORM)
        local = local_slice(tokens, rank, world), local_slice(targets, rank, world)
        loss_fn(model(local[0]), local[1]).backward()
        total = torch.nn.utils.clip_grad_norm_(trainable(model), MAX_NORM)
        got = total.full_tensor() if isinstance(total, DTensor) else total
        assert_close_rel(got, expected, 1e-5, f"strategy {strategy}: total gradient norm")
        norms.append(float(expected))
        for opt in (ref_opt, optimizer):
            opt.step()
            opt.zero_grad()
    state = full_state(model)
    for name, value in reference.state_dict().items():
        assert_close_rel(state[name], value, 1e-5, f"strategy {strategy}: {name} after clipping")
    return norms


@pytest.mark.parametrize("strategy", [1, 3])
def test_clip_grad_norm_sees_the_global_norm_and_keeps_parity(strategy: int) -> None:
    norms = run_distributed(_clipping_worker, 2, strategy, timeout=120)
    assert norms[0] == norms[1]
    assert all(n > MAX_NORM for n in norms[0]), f"clipping never engaged: {norms[0]}"
