"""A plain torch optimizer the engine never sees: nothing process-wide, no stale weights.

From a backward that synced the gradients until the next backward, any forward re-installs
the compute weights from the optimizer-facing ones (``weight_freshness.WeightFreshness``);
an attached optimizer closes that window itself and installs once, right after its step.
"""

from __future__ import annotations

import pytest
import torch
from hooks_models import (
    Block,
    assert_close_rel,
    local_slice,
    loss_fn,
    make_batches,
    make_model,
    make_optimizer,
    shard_blocks,
    trainable,
)
from torch.optim import optimizer as torch_optimizer

from mfsdp_collectives import CommTracer
from mfsdp_collectives.testing import run_distributed
from mfsdp_hooks import FSDPRootWrapper, ShardingOptions, attach_optimizer

STEPS = 10
GLOBAL_BATCH = 8


def _evaluate(model: torch.nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        logits, value = model(tokens)
        return torch.cat([logits.flatten(), value.flatten()]).float()


def _bare_optimizer_worker(rank: int, world: int, strategy: int) -> None:
    batches = make_batches(STEPS, GLOBAL_BATCH)
    probe = make_batches(1, GLOBAL_BATCH, seed=99)[0][0]
    reference = make_model()
    ref_opt = make_optimizer("adamw", trainable(reference))
    model = FSDPRootWrapper(
        make_model(),
        fsdp_unit_modules=[Block],
        options=ShardingOptions(zero_dp_strategy=strategy, sync_model_each_microbatch=False),
    )
    optimizer = make_optimizer("adamw", trainable(model))  # bare: never attached
    for step, (tokens, targets) in enumerate(batches):
        ref_loss = loss_fn(reference(tokens), targets)
        ref_loss.backward()
        local = (local_slice(tokens, rank, world), local_slice(targets, rank, world))
        loss = loss_fn(model(local[0]), local[1])
        loss.backward()
        # An evaluation between backward and step (weights not yet stepped), then one after.
        before = _evaluate(model, probe)
        assert_close_rel(before, _evaluate(reference, probe), 1e-5, f"eval before step {step}")
        ref_opt.step()
        optimizer.step()
        after = _evaluate(model, probe)
        assert_close_rel(after, _evaluate(reference, probe), 1e-5, f"eval after step {step}")
        ref_opt.zero_grad()
        optimizer.zero_grad()
        # Each rank's loss is its half of the batch; their mean is the reference's.
        halves = [torch.zeros(()) for _ in range(world)]
        torch.distributed.all_gather(halves, loss.detach())
        assert_close_rel(torch.stack(halves).mean(), ref_loss.detach(), 1e-5, f"loss {step}")


@pytest.mark.parametrize("strategy", [0, 1, 2, 3])
def test_bare_optimizer_steps_are_seen_by_every_later_forward(strategy: int) -> None:
    run_distributed(_bare_optimizer_worker, 2, strategy, timeout=180)


def _gathers_per_step_worker(rank: int, world: int, strategy: int, attached: bool) -> list[int]:
    model = FSDPRootWrapper(
        make_model(),
        fsdp_unit_modules=[Block],
        options=ShardingOptions(zero_dp_strategy=strategy, sync_model_each_microbatch=False),
    )
    optimizer = make_optimizer("sgd", trainable(model))
    if attached:
        optimizer = attach_optimizer(optimizer)
    counts = []
    for tokens, targets in make_batches(4, GLOBAL_BATCH):
        local = (local_slice(tokens, rank, world), local_slice(targets, rank, world))
        with CommTracer() as tracer:
            loss_fn(model(local[0]), local[1]).backward()
            optimizer.step()
            optimizer.zero_grad()
        counts.append(tracer.calls("all_gather"))
    return counts


@pytest.mark.parametrize("strategy", [1, 2])
def test_weights_are_installed_once_per_step_with_or_without_attach(strategy: int) -> None:
    # ZeRO-1/2 keep the compute weights whole; each step changes them once. 4 units with one
    # trainable group each: 4 installs per step. The attached optimizer installs right after
    # its step (counted in the same step), a bare one at the next forward (the first step
    # has none: nothing was stepped before it).
    attached = run_distributed(_gathers_per_step_worker, 2, strategy, True, timeout=120)
    bare = run_distributed(_gathers_per_step_worker, 2, strategy, False, timeout=120)
    assert attached == [[4, 4, 4, 4]] * 2
    assert bare == [[0, 4, 4, 4]] * 2


def _global_optimizer_hooks() -> tuple[int, int]:
    return (
        len(torch_optimizer._global_optimizer_pre_hooks),
        len(torch_optimizer._global_optimizer_post_hooks),
    )


def _global_hooks_worker(rank: int, world: int) -> tuple[tuple[int, int], tuple[int, int]]:
    before = _global_optimizer_hooks()
    options = ShardingOptions(sync_model_each_microbatch=False)
    model = FSDPRootWrapper(make_model(), fsdp_unit_modules=[Block], options=options)
    optimizer = attach_optimizer(make_optimizer("adamw", trainable(model)))
    tokens, targets = make_batches(1, GLOBAL_BATCH)[0]
    loss_fn(model(local_slice(tokens, rank, world)), local_slice(targets, rank, world)).backward()
    optimizer.step()
    return before, _global_optimizer_hooks()


def test_wrapping_and_attaching_register_no_process_wide_optimizer_hook() -> None:
    for before, after in run_distributed(_global_hooks_worker, 2, timeout=60):
        assert before == after


def _install_worker(rank: int, world: int) -> tuple[int, int, int]:
    from mfsdp_hooks import fsdp_units

    model = make_model()
    shard_blocks(model, "ours", sharding_strategy=1)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    tokens, targets = make_batches(1)[0]
    loss_fn(model(tokens), targets).backward()
    optimizer.step()
    with CommTracer() as tracer:
        model.install_optimized_model_weights()  # type: ignore[operator]
    groups = [g for unit in fsdp_units(model) for g in unit.groups]
    stepped = sum(g.requires_grad for g in groups)
    return tracer.calls("all_gather"), stepped, len(groups)


def test_installing_stepped_weights_gathers_only_the_groups_an_optimizer_steps() -> None:
    """ZeRO-1: one all-gather per trainable group; the frozen group (the toy model has one)
    is not re-gathered (it was, once per call, before)."""
    for gathers, stepped, groups in run_distributed(_install_worker, 2, timeout=60):
        assert groups > stepped
        assert gathers == stepped
