"""With bf16 compute, checkpoints carry the fp32 main weights, and a load re-installs the
compute weights (bf16 copies, replicated buffers of strategies 1/2) before the next forward."""

from __future__ import annotations

from pathlib import Path

import torch
from checkpoint_models import (
    local_slice,
    make_batches,
    make_model,
    make_optimizer,
    shard,
    train,
)
from torch.distributed.tensor import DTensor

import mfsdp_checkpoint as mc
from mfsdp_collectives.testing import run_distributed
from mfsdp_hooks import MixedPrecisionPolicy

BF16 = MixedPrecisionPolicy(param_dtype=torch.bfloat16)


def _world(rank: int, world: int, root: str) -> None:
    tokens, _ = make_batches(1)[0]
    inputs = local_slice(tokens, rank, world)
    for strategy in (1, 3):
        path = str(Path(root) / f"strategy{strategy}")
        model = shard(make_model(), strategy, mp_policy=BF16)
        optimizer = make_optimizer(model)
        train(model, optimizer, make_batches(2), rank, world)
        mc.enable_dcp(model, optimizer)
        state = model.state_dict()
        assert all(v.dtype == torch.float32 for v in state.values()), "fp32 main weights"
        assert all(isinstance(v, DTensor) for v in state.values())
        mc.save_checkpoint(path, model, optimizer)
        with torch.no_grad():
            expected = model(inputs)[0]

        fresh = shard(make_model(seed=42), strategy, mp_policy=BF16)
        fresh_optimizer = make_optimizer(fresh)
        with torch.no_grad():
            fresh(inputs)  # compute weights installed from the random init first
        mc.load_checkpoint(path, fresh, fresh_optimizer)
        with torch.no_grad():
            got = fresh(inputs)[0]
        assert got.dtype == torch.bfloat16
        assert torch.equal(got, expected), f"strategy {strategy}: stale compute weights"
        more = train(fresh, fresh_optimizer, make_batches(3)[2:], rank, world)
        reference = train(model, optimizer, make_batches(3)[2:], rank, world)
        assert more == reference, f"strategy {strategy}: {more} != {reference}"


def test_bf16_compute_fp32_checkpoints_and_fresh_compute_weights(tmp_path: Path) -> None:
    run_distributed(_world, 2, str(tmp_path), timeout=180)
