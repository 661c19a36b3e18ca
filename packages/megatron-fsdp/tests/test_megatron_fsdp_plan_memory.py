"""``plan_memory`` against the engine: the planned peak of a training step (the engine run
for one rank on fake tensors) must be within 3% of the peak measured on the largest rank
while the same model really trains on real gloo ranks (three AdamW steps, so the optimizer
state exists; ``LiveTensorTracker`` counts every tensor storage, and torch's ``MemTracker``
checks three more steps independently), and the bytes between steps within 3% of those live
after ``optimizer.step()``. ZeRO-0/1/2/3, fp32 and bf16 compute, 2 and 4 ranks, HSDP 2x2 and
HFSDP, weights kept over pairs between forward and backward
(``reshard_after_forward_group_size=2``), int8 gradient reduce-scatters
(``quantize_communication``) and activation checkpointing.
"""

from __future__ import annotations

import gc
import os
import time
from dataclasses import dataclass
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed._tools.mem_tracker import MemTracker
from torch.distributed.device_mesh import init_device_mesh
from torch.utils.checkpoint import checkpoint

from megatron_fsdp import (
    MixedPrecisionPolicy,
    fully_shard_model,
    fully_shard_optimizer,
    plan_memory,
    quantize_communication,
)
from megatron_fsdp.plan import MEMORY_CATEGORIES
from mfsdp_buffers import LiveTensorTracker
from mfsdp_collectives.testing import run_distributed

WIDTH, DEPTH, HEADS, SEQ, BATCH, VOCAB = 96, 8, 4, 48, 2, 200


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(WIDTH), nn.LayerNorm(WIDTH)
        self.qkv, self.proj = nn.Linear(WIDTH, 3 * WIDTH), nn.Linear(WIDTH, WIDTH)
        self.fc1, self.fc2 = nn.Linear(WIDTH, 4 * WIDTH), nn.Linear(4 * WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, w = x.shape
        q, k, v = self.qkv(self.norm1(x)).split(w, dim=-1)
        q, k, v = (t.view(b, s, HEADS, w // HEADS).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, s, w))
        return x + self.fc2(F.gelu(self.fc1(self.norm2(x))))


class GPT(nn.Module):
    def __init__(self, checkpointed: bool = False) -> None:
        super().__init__()
        self.checkpointed = checkpointed
        self.tokens = nn.Embedding(VOCAB, WIDTH)
        self.blocks = nn.ModuleList(Block() for _ in range(DEPTH))
        self.norm = nn.LayerNorm(WIDTH)
        self.head = nn.Linear(WIDTH, VOCAB, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tokens(idx)
        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=False) if self.checkpointed else block(x)
        out: torch.Tensor = self.head(self.norm(x))
        return out


def _batch(rank: int, batch: int = BATCH, seq: int = SEQ) -> tuple[torch.Tensor, torch.Tensor]:
    data = torch.randint(0, VOCAB, (batch, seq + 1), generator=torch.Generator().manual_seed(rank))
    return data[:, :-1].contiguous(), data[:, 1:].contiguous()


def _loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.float().reshape(-1, VOCAB), targets.reshape(-1))


@dataclass(frozen=True)
class Case:
    name: str
    world: int
    zero: int = 3
    bf16: bool = False
    outer: int = 1
    outer_strategy: int | str = 0
    pairs: int | None = None
    """``reshard_after_forward_group_size``."""
    int8: bool = False
    """Gradients reduce-scattered in int8 (``quantize_communication``)."""
    checkpointed: bool = False


CASES = [
    Case("zero0", 2, zero=0),
    Case("zero1", 2, zero=1),
    Case("zero2-bf16", 2, zero=2, bf16=True),
    Case("zero3", 2),
    Case("zero3-bf16", 2, bf16=True),
    Case("zero3-int8", 2, int8=True),
    Case("zero1-bf16", 4, zero=1, bf16=True),
    Case("zero3", 4),
    Case("zero3-pairs", 4, pairs=2),
    Case("zero3-checkpointed", 4, checkpointed=True),
    Case("hsdp-2x2", 4, outer=2),
    Case("hfsdp-2x2", 4, outer=2, outer_strategy="optim"),
]


def _policy(bf16: bool) -> MixedPrecisionPolicy | None:
    return MixedPrecisionPolicy(param_dtype=torch.bfloat16) if bf16 else None


def _after_wrap(case: Case) -> Any:
    # On the training thread: a tracker (a dispatch mode, thread-local) cannot see the
    # buffers a background worker allocates; the plan counts them either way.
    return (lambda model: quantize_communication(model, background=False)) if case.int8 else None


def _wrap(case: Case) -> nn.Module:
    hybrid: dict[str, Any] = {}
    if case.outer > 1:
        shard = dist.get_world_size() // case.outer
        mesh = init_device_mesh("cpu", (case.outer, shard), mesh_dim_names=("dp_outer", "dp_shard"))
        hybrid = dict(
            device_mesh=mesh,
            dp_shard_dim="dp_shard",
            dp_outer_dim="dp_outer",
            hybrid_fsdp_group=dist.group.WORLD,
            outer_dp_sharding_strategy=case.outer_strategy,
        )
    model = fully_shard_model(
        GPT(case.checkpointed),
        [Block],
        zero_dp_strategy=case.zero,
        mixed_precision_policy=_policy(case.bf16),
        reshard_after_forward_group_size=case.pairs,
        **hybrid,
    )
    if (after := _after_wrap(case)) is not None:
        after(model)
    return model


def _settle(tracker: LiveTensorTracker) -> None:
    """Let the transport's threads drop what finished reductions read (see memory bounds)."""
    time.sleep(0.05)
    gc.collect()


def _measure(rank: int, world: int, cases: list[Case]) -> list[dict[str, int]]:
    torch.set_num_threads(1)
    results = []
    for case in cases:
        tokens, targets = _batch(rank)
        gc.collect()
        with LiveTensorTracker() as tracker:
            torch.manual_seed(0)
            model = _wrap(case)
            optimizer = fully_shard_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-3))
            for _ in range(3):
                _loss(model(tokens), targets).backward()
                _settle(tracker)
                optimizer.step()
                between = tracker.live
                optimizer.zero_grad()
        independent = MemTracker()
        independent.track_external(model, optimizer)
        with independent:
            for _ in range(3):  # as many steady steps: reductions land at varying points
                _loss(model(tokens), targets).backward()
                optimizer.step()
                optimizer.zero_grad()
                independent.reset_mod_stats()
        snapshot = independent.get_tracker_snapshot("peak")
        results.append(
            {
                "peak": tracker.peak,
                "between": between,
                "memtracker": max(d["Total"] for d in snapshot.values()),
            }
        )
        del model, optimizer
    return results


def _plan(case: Case) -> Any:
    with torch.device("meta"):
        meta = GPT(case.checkpointed)
    tokens, targets = _batch(0)
    return plan_memory(
        meta,
        world_size=case.world,
        example_inputs=(tokens,),
        loss_fn=lambda out: _loss(out, targets),
        fsdp_unit_modules=[Block],
        zero_dp_strategy=case.zero,
        mixed_precision_policy=_policy(case.bf16),
        outer_dp_size=case.outer,
        outer_dp_sharding_strategy=case.outer_strategy,
        device="cpu",
        reshard_after_forward_group_size=case.pairs,
        after_wrap=_after_wrap(case),
    )


FULL = os.environ.get("MFSDP_FULL_MATRIX") == "1"
# CI: 4 ranks (ZeRO-1 bf16, ZeRO-3, pairs, checkpointed, HSDP, HFSDP); MFSDP_FULL_MATRIX=1
# (nox -s tests_full) adds the 2-rank cases.
SKIP = pytest.mark.skip(reason="MFSDP_FULL_MATRIX=1 (nox -s tests_full) runs it")


@pytest.mark.parametrize("world", [pytest.param(2, marks=[] if FULL else [SKIP]), 4])
def test_the_planned_peak_is_the_measured_peak(world: int) -> None:
    cases = [case for case in CASES if case.world == world]
    measured = run_distributed(_measure, world, cases, timeout=240)
    for index, case in enumerate(cases):
        plan = _plan(case)
        assert plan.rank == 0  # the padding is on the last rank: rank 0 holds the most
        peak = max(rank[index]["peak"] for rank in measured)
        between = max(rank[index]["between"] for rank in measured)
        independent = max(rank[index]["memtracker"] for rank in measured)
        shown = (case.name, str(plan))
        assert abs(plan.peak_bytes / peak - 1) <= 0.03, (plan.peak_bytes, peak, shown)
        assert abs(plan.peak_bytes / independent - 1) <= 0.03, (independent, shown)
        assert abs(plan.between_steps_bytes / between - 1) <= 0.03, (between, shown)
        assert sum(plan.categories.values()) == plan.peak_bytes
        assert set(plan.categories) == set(MEMORY_CATEGORIES)
        assert plan.peak_phase in {phase.phase for phase in plan.phases}
