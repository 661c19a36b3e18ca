"""``FSDPRootWrapper.broadcast_params`` and ``scale_gradients`` (Megatron-Core's
``--data-parallel-random-init`` and its gradient scaling; the seed's ``MegatronFSDP`` inherits
them), on 2 gloo ranks under ``no_shard``: each rank holds whole weights, so only a broadcast
makes them rank 0's.
"""

from __future__ import annotations

from typing import Any

import torch

from mfsdp_collectives.testing import run_distributed
from mfsdp_hooks import FSDPRootWrapper, ShardingOptions
from mfsdp_hooks.testing import Block, loss_fn, make_batches, make_model


def _worker(rank: int, world: int) -> dict[str, Any]:
    # Another seed on each rank, wrapped without the replica check: the broadcast makes the
    # weights equal after wrapping.
    options = ShardingOptions(zero_dp_strategy=0, check_replicas=False)
    model = FSDPRootWrapper(make_model(seed=100 + rank), [Block], options)
    model.broadcast_params()
    tokens, targets = make_batches(1)[0]
    loss = loss_fn(model(tokens), targets)  # the same batch: equal on equal weights
    loss.backward()
    model.finish_grad_sync()
    grads = {
        n: p.grad.to_local().clone() for n, p in model.named_parameters() if p.grad is not None
    }
    model.scale_gradients(0.5)
    halved = [
        torch.equal(p.grad.to_local(), grads[n] * 0.5)
        for n, p in model.named_parameters()
        if p.grad is not None
    ]
    return {
        "weights": {
            n.removeprefix("module."): p.full_tensor().tolist() for n, p in model.named_parameters()
        },
        "loss": loss.item(),
        "halved": bool(halved) and all(halved),
    }


def test_broadcast_params_gives_every_rank_rank0s_weights_and_scale_gradients_scales() -> None:
    results = run_distributed(_worker, 2, timeout=120)
    rank0 = {n: p.tolist() for n, p in make_model(seed=100).named_parameters()}
    for result in results:
        assert result["weights"] == rank0
        assert result["halved"]
    # The compute weights followed: the forward after the broadcast ran on rank 0's weights.
    assert results[0]["loss"] == results[1]["loss"]
