"""Contiguous optimizer steps: bit-identical to torch's per-parameter loop, on plain chunks."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch
from hooks_models import Block, local_slice, loss_fn, make_batches, make_model, trainable
from torch.distributed.tensor import DTensor

from mfsdp_collectives.testing import run_distributed
from mfsdp_hooks import (
    FSDPRootWrapper,
    MixedPrecisionPolicy,
    ShardingOptions,
    attach_optimizer,
)
from mfsdp_hooks.optim.contiguous_step import CONTIGUOUS_STEP_OPTIMIZERS, ContiguousStepper
from mfsdp_hooks.runtime.elementwise_optimizers import TORCH_ELEMENTWISE
from mfsdp_hooks.testing.parity import shard_blocks

OPTIMIZERS: dict[str, Callable[[Any], torch.optim.Optimizer]] = {
    "adamw": lambda p: torch.optim.AdamW(p, lr=1e-2, weight_decay=0.1),
    "adam-amsgrad": lambda p: torch.optim.Adam(p, lr=1e-2, amsgrad=True, weight_decay=0.05),
    "adamw-fused": lambda p: torch.optim.AdamW(p, lr=1e-2, fused=True),
    "adamw-foreach": lambda p: torch.optim.AdamW(p, lr=1e-2, foreach=True, maximize=True),
    "sgd-nesterov": lambda p: torch.optim.SGD(
        p, lr=5e-2, momentum=0.9, nesterov=True, weight_decay=0.01
    ),
    "sgd-plain": lambda p: torch.optim.SGD(p, lr=5e-2),
}


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _assert_same(
    per_param: torch.optim.Optimizer, contiguous: torch.optim.Optimizer, where: str
) -> None:
    params_a = [p for g in per_param.param_groups for p in g["params"]]
    params_b = [p for g in contiguous.param_groups for p in g["params"]]
    for index, (a, b) in enumerate(zip(params_a, params_b, strict=True)):
        assert torch.equal(_local(a), _local(b)), f"{where}: weight {index} differs"
        state_a, state_b = per_param.state.get(a, {}), contiguous.state.get(b, {})
        assert set(state_a) == set(state_b), f"{where}: state keys of {index} differ"
        for key, value in state_a.items():
            assert torch.equal(_local(value), _local(state_b[key])), f"{where}: {key} of {index}"
            if isinstance(value, DTensor):
                other = state_b[key]
                assert isinstance(other, DTensor) and other.placements == value.placements
                assert other.shape == value.shape, f"{where}: {key} of {index} global shape"


def _same_steps_worker(rank: int, world: int, strategy: int) -> None:
    batches = make_batches(6, 8)
    chunk = 13  # cuts chunks inside parameters, and makes runs of several chunks
    for name, build in OPTIMIZERS.items():
        options = ShardingOptions(zero_dp_strategy=strategy, sync_model_each_microbatch=False)
        models = [
            FSDPRootWrapper(make_model(), fsdp_unit_modules=[Block], options=options)
            for _ in range(2)
        ]
        per_param = attach_optimizer(build(trainable(models[0])), contiguous_step=False)
        contiguous = attach_optimizer(build(trainable(models[1])), step_chunk_numel=chunk)
        seen: list[list[torch.Tensor]] = []

        def record(opt: torch.optim.Optimizer, *_: Any, seen: list[Any] = seen) -> None:
            seen.append([t for g in opt.param_groups for t in g["params"]])

        contiguous.register_step_pre_hook(record)
        for step, (tokens, targets) in enumerate(batches):
            local = local_slice(tokens, rank, world), local_slice(targets, rank, world)
            for model in models:
                loss_fn(model(local[0]), local[1]).backward()
            if step == 2:  # a gradient the user replaced: that run takes torch's loop
                for model in models:
                    model.finish_grad_sync()
                for opt in (per_param, contiguous):
                    first = opt.param_groups[0]["params"][0]
                    first.grad = first.grad.clone()
            if step == 3:  # state reloaded from a state dict: adopted by copy
                for opt in (per_param, contiguous):
                    opt.load_state_dict(copy.deepcopy(opt.state_dict()))
            if step == 5:  # a parameter moved out of the planned buffer: the run is re-planned
                for opt in (per_param, contiguous):
                    first = opt.param_groups[0]["params"][0]
                    moved = first._local_tensor if isinstance(first, DTensor) else first
                    with torch.no_grad():
                        moved.set_(moved.clone())
            if step == 4:
                for opt in (per_param, contiguous):
                    opt.step(lambda: None)  # a closure: torch's loop, no flat chunks
            else:
                per_param.step()
                contiguous.step()
            per_param.zero_grad()
            contiguous.zero_grad()
            _assert_same(per_param, contiguous, f"{name} strategy {strategy} step {step}")
        flat_steps = [seen[s] for s in (0, 1, 3, 5)]
        if name.endswith("-fused"):  # fused groups keep torch's single call over the list
            assert all(isinstance(t, DTensor) for t in flat_steps[0]) or strategy == 0, name
            continue
        for listed in flat_steps:
            assert not any(isinstance(t, DTensor) for t in listed), name
            assert all(t.numel() <= chunk for t in listed), name
        assert any(isinstance(t, DTensor) for t in seen[4]), name
        restored = [p for g in contiguous.param_groups for p in g["params"]]
        assert [id(p) for p in restored] == [id(p) for p in trainable(models[1])], name


@pytest.mark.parametrize("strategy", [0, 1, 3])
def test_contiguous_step_is_bit_identical_to_per_parameter_step(strategy: int) -> None:
    run_distributed(_same_steps_worker, 2, strategy, timeout=240)


def _bf16_worker(rank: int, world: int) -> None:
    # bf16 compute weights are re-cast from the fp32 main weights the chunks update in place.
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    models = []
    for _ in range(2):
        model = make_model()
        shard_blocks(model, mp_policy=policy)
        models.append(model)
    per_param = attach_optimizer(OPTIMIZERS["adamw"](trainable(models[0])), contiguous_step=False)
    contiguous = attach_optimizer(OPTIMIZERS["adamw"](trainable(models[1])), step_chunk_numel=29)
    for step, (tokens, targets) in enumerate(make_batches(4, 8)):
        local = local_slice(tokens, rank, world), local_slice(targets, rank, world)
        losses = [loss_fn(model(local[0]), local[1]) for model in models]
        assert torch.equal(losses[0], losses[1]), f"bf16 step {step}: losses differ"
        for loss in losses:
            loss.backward()
        for opt in (per_param, contiguous):
            opt.step()
            opt.zero_grad()
        _assert_same(per_param, contiguous, f"bf16 step {step}")


def test_contiguous_step_under_bf16_compute() -> None:
    run_distributed(_bf16_worker, 2, timeout=120)


def _param_groups_worker(rank: int, world: int) -> list[int]:
    # The usual GPT recipe: no weight decay on 1-D parameters, a learning-rate schedule.
    # Group membership alternates inside a unit's buffer, so runs are short but still flat.
    options = ShardingOptions(sync_model_each_microbatch=False)
    models = [
        FSDPRootWrapper(make_model(), fsdp_unit_modules=[Block], options=options) for _ in range(2)
    ]
    optimizers = []
    for index, model in enumerate(models):
        params = trainable(model)
        groups = [
            {"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.1},
            {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0, "lr": 3e-3},
        ]
        optimizer = attach_optimizer(torch.optim.AdamW(groups, lr=1e-2), contiguous_step=index == 1)
        optimizers.append((optimizer, torch.optim.lr_scheduler.StepLR(optimizer, 2, gamma=0.5)))
    stepped_dtensors: list[int] = []

    def record(opt: torch.optim.Optimizer, *_: Any) -> None:
        listed = [t for g in opt.param_groups for t in g["params"]]
        stepped_dtensors.append(sum(isinstance(t, DTensor) for t in listed))

    optimizers[1][0].register_step_pre_hook(record)
    for step, (tokens, targets) in enumerate(make_batches(5, 8)):
        local = local_slice(tokens, rank, world), local_slice(targets, rank, world)
        for model in models:
            loss_fn(model(local[0]), local[1]).backward()
        for optimizer, schedule in optimizers:
            optimizer.step()
            optimizer.zero_grad()
            schedule.step()
        _assert_same(optimizers[0][0], optimizers[1][0], f"param groups, step {step}")
    return stepped_dtensors


def test_contiguous_step_with_param_groups_and_a_schedule() -> None:
    for stepped_dtensors in run_distributed(_param_groups_worker, 2, timeout=120):
        assert stepped_dtensors == [0] * 5, stepped_dtensors


def _dropped_grad_worker(rank: int, world: int) -> None:
    # A parameter without a gradient is skipped by torch (its step counter stays behind), so
    # its run cannot share one counter: it must keep taking the per-parameter loop, correctly.
    batches = make_batches(4, 8)
    options = ShardingOptions(sync_model_each_microbatch=False)
    models = [
        FSDPRootWrapper(make_model(), fsdp_unit_modules=[Block], options=options) for _ in range(2)
    ]
    per_param = attach_optimizer(OPTIMIZERS["adamw"](trainable(models[0])), contiguous_step=False)
    contiguous = attach_optimizer(OPTIMIZERS["adamw"](trainable(models[1])))
    for step, (tokens, targets) in enumerate(batches):
        local = local_slice(tokens, rank, world), local_slice(targets, rank, world)
        for model in models:
            loss_fn(model(local[0]), local[1]).backward()
        if step == 1:
            for model in models:
                model.finish_grad_sync()
            for opt in (per_param, contiguous):
                opt.param_groups[0]["params"][1].grad = None
        per_param.step()
        contiguous.step()
        per_param.zero_grad()
        contiguous.zero_grad()
        _assert_same(per_param, contiguous, f"dropped grad, step {step}")
    steps = {float(s["step"]) for s in contiguous.state.values()}
    assert steps == {3.0, 4.0}, steps


def test_contiguous_step_with_a_dropped_gradient() -> None:
    run_distributed(_dropped_grad_worker, 2, timeout=120)


def test_contiguous_step_optimizers_are_allowed_to_step_shards() -> None:
    # The flat-view step is only reached for optimizers the engine lets step shards at all.
    outside = set(CONTIGUOUS_STEP_OPTIMIZERS) - set(TORCH_ELEMENTWISE)
    assert not outside, f"{sorted(c.__name__ for c in outside)} missing from TORCH_ELEMENTWISE"


def test_contiguous_step_rejects_bad_arguments() -> None:
    model = torch.nn.Linear(2, 2)
    with pytest.raises(TypeError, match="contiguous_step=False"):
        ContiguousStepper(torch.optim.RMSprop(model.parameters()), lambda p: True)
    with pytest.raises(ValueError, match="step_chunk_numel"):
        ContiguousStepper(torch.optim.SGD(model.parameters(), lr=0.1), lambda p: True, 0)
