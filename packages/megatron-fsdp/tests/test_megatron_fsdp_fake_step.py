"""The engine steps one rank of a world on torch's fake tensors and fake process group, and
holds exactly what that rank holds in a real run (issue 52's spike: plan by running).

A planning run needs no peers and no memory: ``init_process_group("fake")`` stands in for the
world, ``FakeTensorMode`` for the tensors (shapes and dtypes only), and
``LiveTensorTracker(fake=True)`` counts the storages a real run would allocate. The real
``fully_shard_model`` and three real AdamW steps (forward, backward, the optimizer) then
give, for every rank, the same peak and the same bytes between steps as 4 real gloo ranks
training the same model (to the byte; shared-memory reductions, which a fake world cannot
have, are off in both).
"""

from __future__ import annotations

import gc
import multiprocessing
import os
import traceback
from concurrent.futures import ProcessPoolExecutor

import pytest
import torch
import torch.distributed as dist
from test_megatron_fsdp_plan_memory import GPT, Block, _batch, _loss

from megatron_fsdp import fully_shard_model, fully_shard_optimizer
from mfsdp_buffers import LiveTensorTracker
from mfsdp_collectives.testing import run_distributed

WORLD = 4
FULL = os.environ.get("MFSDP_FULL_MATRIX") == "1"  # CI: ZeRO-3 (19 s); the full run adds ZeRO-1


def _three_steps(rank: int, zero: int, fake: bool) -> tuple[int, int]:
    """Peak and between-steps live bytes of three steps of this rank."""
    torch.set_num_threads(1)
    tokens, targets = _batch(rank)
    gc.collect()
    with LiveTensorTracker(fake=fake) as tracker:
        torch.manual_seed(0)
        model = fully_shard_model(GPT(), [Block], zero_dp_strategy=zero, host_transport="gloo")
        optimizer = fully_shard_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-3))
        for _ in range(3):
            _loss(model(tokens), targets).backward()
            gc.collect()
            optimizer.step()
            between = tracker.live
            optimizer.zero_grad()
    return tracker.peak, between


def _real(rank: int, world: int, zero: int) -> tuple[int, int]:
    return _three_steps(rank, zero, fake=False)


def _fake(rank: int, zero: int) -> tuple[int, int]:
    """In a fresh process: one rank of ``WORLD`` alone, nothing allocated."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=WORLD)
    try:
        with FakeTensorMode(allow_non_fake_inputs=True):
            return _three_steps(rank, zero, fake=True)
    except Exception as error:  # torch's fake-tensor errors do not pickle back: say it here
        raise RuntimeError(f"rank {rank}: {traceback.format_exc()}") from error
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize(
    "zero",
    [3, pytest.param(1, marks=pytest.mark.skipif(not FULL, reason="MFSDP_FULL_MATRIX=1 only"))],
)
def test_one_fake_rank_holds_what_a_real_rank_holds(zero: int) -> None:
    real = run_distributed(_real, WORLD, zero, timeout=300)
    spawn = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(max_workers=1, mp_context=spawn) as pool:
        fake = [pool.submit(_fake, rank, zero).result(timeout=300) for rank in range(WORLD)]
    assert fake == real, (fake, real)
    assert all(peak > between > 0 for peak, between in fake)
