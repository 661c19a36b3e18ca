"""``describe()``: the sharding summary a user prints after wrapping (issue 31, part).

The bytes each rank reports are checked against what the strategy means, computed from the
model and the world size, not read back from the engine: under ZeRO-3 the ranks' weight
shards add up to the whole (padded) model and no rank holds more than its share; under
ZeRO-1 every rank holds the whole model but only its shard of the gradients; with bf16
compute the fp32 main shard is what persists and the gathered weights are bf16; and AdamW's
two moments, summed over the ranks, are twice the model, each element counted once.
"""

from __future__ import annotations

import pytest
import torch
from hooks_models import ResidualBlock, residual_model

from mfsdp_collectives.testing import run_distributed
from mfsdp_hooks import (
    FSDPRootWrapper,
    MixedPrecisionPolicy,
    ShardingOptions,
    ShardingSummary,
    describe,
    fully_shard,
)

MODEL_NUMEL = sum(p.numel() for p in residual_model().parameters())


def _describe(rank: int, world: int, strategy: int, bf16: bool) -> tuple[ShardingSummary, str]:
    model = residual_model()
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16) if bf16 else None
    for block in (model[1], model[2]):
        fully_shard(block, sharding_strategy=strategy, mp_policy=policy)
    fully_shard(model, sharding_strategy=strategy, mp_policy=policy)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(3, 8)).float().sum().backward()
    optimizer.step()
    summary = model.describe_sharding(optimizer)  # type: ignore[operator]
    return summary, str(summary)


def _sum(summaries: list[ShardingSummary], category: str) -> int:
    return sum(s.totals()[category] for s in summaries)


@pytest.mark.parametrize(
    ("world", "strategy", "bf16"), [(2, 3, False), (4, 3, True), (2, 1, False)]
)
def test_bytes_per_rank_are_what_the_strategy_means(world: int, strategy: int, bf16: bool) -> None:
    results = run_distributed(_describe, world, strategy, bf16, timeout=60)
    summaries = [summary for summary, _ in results]
    first = summaries[0]
    assert sum(g.numel for g in first.groups) == MODEL_NUMEL
    assert [g.unit for g in first.groups] == ["", "1", "2"]  # module order: the root first
    padded = sum(g.padded_numel for g in first.groups)
    assert padded >= MODEL_NUMEL
    compute_bytes = 2 if bf16 else 4
    for summary in summaries:
        totals = summary.totals()
        assert summary.world_size == world
        assert {g.gather_dtype for g in summary.groups} == {
            torch.bfloat16 if bf16 else torch.float32
        }
        assert totals["gradients"] == padded * 4 // world  # the shard the optimizer steps
        if strategy == 3:
            assert totals["gathered_weights"] == padded * compute_bytes
            held = "main_weights" if bf16 else "compute_weights"
            assert totals[held] == padded * 4 // world  # one shard: 1/world of the model
            assert totals["compute_weights" if bf16 else "main_weights"] == 0
        else:  # ZeRO-1: the whole compute weights on every rank
            assert totals["compute_weights"] == padded * 4
            assert totals["gathered_weights"] == 0
        assert summary.between_steps_bytes == sum(totals.values()) - totals["gathered_weights"]
    steps = 4 * sum(len(g.params) for g in first.groups)
    moments = _sum(summaries, "optimizer_state") - world * steps  # AdamW's 0-d fp32 "step"
    assert moments == 2 * 4 * MODEL_NUMEL  # exp_avg + exp_avg_sq, every element once
    table = results[0][1]
    assert "rank 0 of" in table and "total" in table and "ZeRO-" in table
    assert "dp_shard=" + str(world) in table


def _unit_names(rank: int, world: int) -> tuple[list[str], str, list[str]]:
    """A root wrapper's unit names and table, and those of a unit over two modules."""
    model = residual_model()
    wrapper = FSDPRootWrapper(model, [ResidualBlock], ShardingOptions())
    summary = describe(wrapper)
    paired = residual_model()
    fully_shard([paired[0], paired[3]])  # one unit over two modules, as for tied weights
    fully_shard(paired)
    pair_names = [g.unit for g in describe(paired).groups]
    return [g.unit for g in summary.groups], str(wrapper.describe_sharding()), pair_names


def test_unit_names_follow_the_module_the_root_wrapper_and_a_unit_of_several_modules() -> None:
    """A unit of several modules is named by its first (its ``unit.module`` is a container
    outside the model: describe raised KeyError)."""
    units, table, pair_names = run_distributed(_unit_names, 2, timeout=60)[0]
    assert units == ["module", "module.1", "module.2"]
    assert "(root)" in table  # wrapper.describe_sharding() is the wrapped model's: its own names
    assert pair_names == ["", "0"]


def test_an_unsharded_model_is_refused_naming_the_fix() -> None:
    with pytest.raises(ValueError, match="no FSDP units; shard it first"):
        describe(residual_model())
