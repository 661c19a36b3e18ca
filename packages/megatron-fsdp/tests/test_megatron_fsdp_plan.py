"""``plan_model_states``: the model-state bytes of every rank, planned with no process group
from a meta-device model, must equal what the engine holds on that rank once the model is
really sharded (``describe()`` after one AdamW step), category by category, for ZeRO-0..3,
fp32 and bf16 compute, at 2 and 4 ranks. The model has odd shapes (padding), a frozen
parameter and a tied one, so packing, ownership and per-rank rows all have to match.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from megatron_fsdp import MixedPrecisionPolicy, fully_shard_model, fully_shard_optimizer
from megatron_fsdp.plan import MODEL_STATE_CATEGORIES, plan_model_states
from mfsdp_collectives.testing import run_distributed


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(13, 29)
        self.down = nn.Linear(29, 13)
        self.gate = nn.Parameter(torch.ones(7), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(x))) * self.gate.sum() / 7


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(37, 13)
        self.blocks = nn.Sequential(Block(), Block(), Block())
        self.head = nn.Linear(13, 37, bias=False)
        self.head.weight = self.embed.weight  # tied: one parameter, owned by the root

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(self.embed(tokens)))


def _policy(bf16: bool) -> MixedPrecisionPolicy | None:
    return MixedPrecisionPolicy(param_dtype=torch.bfloat16) if bf16 else None


CASES = {2: [(0, False), (1, False), (2, False), (3, False)], 4: [(3, True), (1, True), (2, False)]}


def _engine(rank: int, world: int) -> list[dict[str, int]]:
    held = []
    for strategy, bf16 in CASES[world]:
        torch.manual_seed(0)
        model = fully_shard_model(
            Net(), [Block], zero_dp_strategy=strategy, mixed_precision_policy=_policy(bf16)
        )
        optimizer = fully_shard_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-3))
        model(torch.randint(0, 37, (2, 5))).float().sum().backward()
        optimizer.step()
        totals = model.describe_sharding(optimizer).totals()
        held.append({c: totals[c] for c in MODEL_STATE_CATEGORIES})
    return held


@pytest.mark.parametrize("world", [2, 4])
def test_the_plan_is_what_each_rank_holds(world: int) -> None:
    ranks = run_distributed(_engine, world, timeout=90)
    with torch.device("meta"):
        meta = Net()
    for case, (strategy, bf16) in enumerate(CASES[world]):
        plan = plan_model_states(
            meta,
            world_size=world,
            fsdp_unit_modules=[Block],
            zero_dp_strategy=strategy,
            mixed_precision_policy=_policy(bf16),
            optimizer="adamw",
        )
        for rank in range(world):
            assert plan.per_rank[rank] == ranks[rank][case], (strategy, bf16, rank)
        assert plan.categories == max(plan.per_rank, key=lambda sizes: sum(sizes.values()))
        assert "ZeRO-" in str(plan) and plan.between_steps_bytes == sum(plan.categories.values())


def test_a_large_world_is_planned_from_meta_without_memory() -> None:
    with torch.device("meta"):
        model = nn.Sequential(*(nn.Linear(4096, 4096) for _ in range(8)))
    plan = plan_model_states(model, world_size=1024, fsdp_unit_modules=[nn.Linear])
    numel = sum(p.numel() for p in model.parameters())
    assert len(plan.per_rank) == 1024
    # fp32 ZeRO-3 + AdamW: weights, gradients, two moments, each a 1/1024 shard of whole
    # rows: a shard of a 4096-wide layer is a multiple of 4096 elements, so each of the 8
    # units pads by at most 1024 rows in all (FlatLayout's bound).
    lower, padding = 16 * numel / 1024, 16 * 8 * 1024 * 4096 / 1024
    assert lower <= plan.between_steps_bytes <= lower + padding
    assert plan.categories["compute_weights"] == plan.categories["gradients"]


def test_bad_arguments_name_themselves() -> None:
    model = nn.Linear(2, 2)
    with pytest.raises(ValueError, match="world_size must be a positive int"):
        plan_model_states(model, world_size=0)
    with pytest.raises(ValueError, match="optimizer='lamb'"):
        plan_model_states(model, world_size=2, optimizer="lamb")
