"""Gradient accumulation, activation recompute, mixed precision and gradient options."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from hooks_models import (
    Block,
    assert_close_rel,
    full_state,
    local_rows,
    local_slice,
    loss_fn,
    make_batches,
    make_model,
    make_optimizer,
    reference_training,
)

from mfsdp_collectives import CommTracer
from mfsdp_collectives.testing import run_distributed
from mfsdp_hooks import (
    FSDPRootWrapper,
    MixedPrecisionPolicy,
    ShardingOptions,
    attach_optimizer,
    locate,
)
from mfsdp_hooks.testing.parity import shard_blocks

MICRO = 4
GLOBAL_BATCH = 8


def _accumulation_worker(rank: int, world: int, strategy: int, mode: str) -> None:
    steps = 4
    batches = make_batches(steps * MICRO, GLOBAL_BATCH)
    reference = make_model()
    ref_opt = make_optimizer("adamw", [p for p in reference.parameters() if p.requires_grad])
    model = FSDPRootWrapper(
        make_model(),
        fsdp_unit_modules=[Block],
        options=ShardingOptions(
            zero_dp_strategy=strategy,
            sync_model_each_microbatch=(mode == "sync_each_microbatch"),
        ),
    )
    optimizer = attach_optimizer(
        make_optimizer("adamw", [p for p in model.parameters() if p.requires_grad])
    )
    for step in range(steps):
        micro = batches[step * MICRO : (step + 1) * MICRO]
        for index, (tokens, targets) in enumerate(micro):
            (loss_fn(reference(tokens), targets) / MICRO).backward()
            local = (local_slice(tokens, rank, world), local_slice(targets, rank, world))
            last = index == MICRO - 1
            if mode == "no_sync" and not last:
                with model.no_sync():
                    (loss_fn(model(local[0]), local[1]) / MICRO).backward()
            else:
                (loss_fn(model(local[0]), local[1]) / MICRO).backward()
        ref_opt.step()
        ref_opt.zero_grad()
        optimizer.step()
        optimizer.zero_grad()
    expected = {k: v for k, v in reference.state_dict().items()}
    got = full_state(model.module)
    for name, value in expected.items():
        assert_close_rel(got[name], value, 1e-5, f"{mode} strategy={strategy} {name}")


@pytest.mark.parametrize("mode", ["no_sync", "sync_each_microbatch", "overlapped"])
@pytest.mark.parametrize("strategy", [0, 1, 2, 3])
def test_gradient_accumulation_parity(strategy: int, mode: str) -> None:
    run_distributed(_accumulation_worker, 2, strategy, mode, timeout=120)


def _no_sync_skips_reduction_worker(rank: int, world: int, strategy: int) -> list[int]:
    options = ShardingOptions(zero_dp_strategy=strategy, sync_model_each_microbatch=False)
    model = FSDPRootWrapper(make_model(), fsdp_unit_modules=[Block], options=options)
    tokens, targets = make_batches(1, 4)[0]
    with CommTracer() as tracer, model.no_sync():
        loss_fn(model(tokens), targets).backward()
    reductions = tracer.calls("reduce_scatter") + tracer.calls("all_reduce")
    model.finish_grad_sync()
    return [reductions]


@pytest.mark.parametrize(("strategy", "expected"), [(0, 0), (1, 0), (2, 4), (3, 4)])
def test_no_sync_reduces_only_for_sharded_grads(strategy: int, expected: int) -> None:
    # 4 units (3 blocks + root) with one trainable group each; the root's frozen group never
    # reduces. ZeRO-2/3 reduce-scatter every microbatch, ZeRO-0/1 keep gradients local.
    results = run_distributed(_no_sync_skips_reduction_worker, 2, strategy, timeout=60)
    assert results == [[expected], [expected]]


def _root_setter_worker(
    rank: int, world: int, setting: bool, before_first_forward: bool, api: str
) -> list[int]:
    """3 blocks + root as units (ZeRO-3): per-module ``fully_shard``, or the root wrapper
    (the seed API's class); two no_sync micro-batches then a synced one; the root's
    ``set_reduce_scatter_in_no_sync(setting)`` called before the root exists or after a first
    step. Reduce-scatters per micro-batch of the second step."""
    model: Any = make_model()
    if api == "per_module":
        shard_blocks(model)
    else:
        options = ShardingOptions(zero_dp_strategy=3, sync_model_each_microbatch=False)
        model = FSDPRootWrapper(model, fsdp_unit_modules=[Block], options=options)
    batches = make_batches(2, 4)
    if not before_first_forward:
        loss_fn(model(batches[0][0]), batches[0][1]).backward()
    model.set_reduce_scatter_in_no_sync(setting)
    root = model if api == "per_module" else model.root_unit_module
    assert root.reduce_scatter_in_no_sync is setting
    counts = []
    tokens, targets = batches[1]
    for synced in (False, False, True):
        model.set_requires_gradient_sync(synced)
        with CommTracer() as tracer:
            loss_fn(model(tokens), targets).backward()
        counts.append(tracer.calls("reduce_scatter"))
    return counts


@pytest.mark.parametrize("api", ["per_module", "root_wrapper"])
@pytest.mark.parametrize("before_first_forward", [True, False], ids=["before", "after"])
@pytest.mark.parametrize(("setting", "expected"), [(True, [4, 4, 4]), (False, [0, 0, 4])])
def test_root_set_reduce_scatter_in_no_sync_chooses_per_micro_batch_or_once(
    setting: bool, expected: list[int], before_first_forward: bool, api: str
) -> None:
    """True: Megatron-FSDP's no_sync (each unit reduce-scatters every micro-batch); False:
    FSDP2's (the unsharded gradients wait for the synced backward). 4 units reduce."""
    results = run_distributed(
        _root_setter_worker, 2, setting, before_first_forward, api, timeout=60
    )
    assert results == [expected, expected]


def _recompute_worker(rank: int, world: int, mode: str) -> tuple[int, int]:
    batches = make_batches(3, GLOBAL_BATCH)
    ref_losses, ref_state = reference_training("sgd", batches)
    model = make_model(checkpoint=mode)
    shard_blocks(model)
    optimizer = make_optimizer("sgd", [p for p in model.parameters() if p.requires_grad])
    counts = []
    for step, (tokens, targets) in enumerate(batches):
        with CommTracer() as tracer:
            loss = loss_fn(
                model(local_slice(tokens, rank, world)), local_slice(targets, rank, world)
            )
            forward_gathers = tracer.calls("all_gather")
            loss.backward()
        counts.append((forward_gathers, tracer.calls("all_gather")))
        optimizer.step()
        optimizer.zero_grad()
        total = loss.detach().clone()
        torch.distributed.all_reduce(total)
        assert abs(total.item() / world - ref_losses[step]) <= 1e-5 * ref_losses[step]
    state = full_state(model)
    for name, value in ref_state.items():
        assert_close_rel(state[name], value, 1e-5, f"recompute {mode} {name}")
    return counts[-1]


@pytest.mark.parametrize("mode", ["reentrant", "non_reentrant"])
def test_activation_recompute_parity_without_double_gather(mode: str) -> None:
    counts = run_distributed(_recompute_worker, 2, mode, timeout=120)
    # Forward: the root's two groups (trainable, frozen) + 3 blocks. Backward: each block once;
    # a second gather for the recomputed forward would make it 11.
    assert counts == [(5, 8), (5, 8)]


def _bf16_worker(rank: int, world: int) -> None:
    steps = 20
    batches = make_batches(steps, GLOBAL_BATCH)
    ref_losses, ref_state = reference_training("sgd", batches)
    model = make_model()
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    shard_blocks(model, mp_policy=policy)
    params = [p for p in model.parameters() if p.requires_grad]
    assert all(p.dtype == torch.float32 for p in params), "optimizer must see fp32 main weights"
    optimizer = make_optimizer("sgd", params)
    for step, (tokens, targets) in enumerate(batches):
        loss = loss_fn(model(local_slice(tokens, rank, world)), local_slice(targets, rank, world))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        total = loss.detach().float()
        torch.distributed.all_reduce(total)
        assert abs(total.item() / world - ref_losses[step]) <= 3e-2 * ref_losses[step], step
    for name, param in model.named_parameters():
        local = param.to_local()
        assert local.dtype == torch.float32, name
        assert_close_rel(local, ref_state[name][local_rows(param)], 2e-2, f"bf16 {name}", atol=5e-3)
    state = full_state(model)
    assert all(state[name].dtype == torch.float32 for name in state)


def test_bf16_compute_with_fp32_main_weights() -> None:
    run_distributed(_bf16_worker, 2, timeout=120)


def _grad_options_worker(rank: int, world: int, option: str) -> list[float]:
    tokens, targets = make_batches(1, GLOBAL_BATCH)[0]
    reference = make_model()
    loss_fn(reference(tokens), targets).backward()
    model = make_model()
    kwargs: dict[str, Any] = {}
    if option == "scaling":
        kwargs["gradient_scaling_factor"] = 0.25
    elif option == "per_token":
        kwargs["calculate_per_token_loss"] = True
    elif option == "pre_divide":
        kwargs["average_in_collective"] = False
    shard_blocks(model, **kwargs)
    loss_fn(model(local_slice(tokens, rank, world)), local_slice(targets, rank, world)).backward()
    # Every rank computes the mean over its local slice; the reference grads are the mean of
    # those local means, so a sum is `world` times the reference and scaling multiplies it.
    factor = {"scaling": 0.25 * world, "per_token": float(world), "pre_divide": 1.0}[option]
    for name, param in model.named_parameters():
        if param.grad is None:
            continue
        ref_grad = dict(reference.named_parameters())[name].grad
        assert ref_grad is not None
        piece = param.grad.to_local()
        rows = local_rows(param)
        assert_close_rel(piece, ref_grad[rows] * factor, 1e-5, f"{option} {name}")
    return [factor]


@pytest.mark.parametrize("option", ["scaling", "per_token", "pre_divide"])
def test_gradient_scaling_options(option: str) -> None:
    run_distributed(_grad_options_worker, 2, option, timeout=60)


def _nan_worker(rank: int, world: int) -> str:
    model = make_model()
    shard_blocks(model, report_nan_in_param_grad=True)
    # the parameter backward uses (the original is left with its stale values, as in FSDP2)
    where = locate(model.blocks[1].fc1.weight)
    assert where is not None
    if rank == 1:
        where.group.unsharded_params[where.index].register_hook(lambda g: g * float("nan"))
    tokens, targets = make_batches(1, 4)[0]
    loss = loss_fn(model(tokens), targets)
    try:
        loss.backward()
    except RuntimeError as error:
        return str(error)
    return "no error"


def test_nan_in_grad_is_reported_on_every_rank_with_the_parameter_name() -> None:
    messages = run_distributed(_nan_worker, 2, timeout=60)
    for message in messages:
        assert "NaN or Inf in the reduced gradient of ['blocks.1.fc1.weight']" in message, message
