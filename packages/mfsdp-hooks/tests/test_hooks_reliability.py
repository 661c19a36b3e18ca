"""Never a silent wrong result: what the engine cannot train right is refused at wrap time,
ranks that disagree fail together before any collective can mismatch, and a non-finite
gradient stops the step before any weight moves.
"""

from __future__ import annotations

import importlib.util
from typing import Any

import pytest
import torch
from hooks_models import Block, local_slice, loss_fn, make_batches, make_model, trainable
from torch import nn
from torch.distributed.tensor import DTensor

from mfsdp_collectives import RankMismatchError
from mfsdp_collectives.testing import run_distributed, run_distributed_outcomes
from mfsdp_hooks import FSDPRootWrapper, ShardingOptions, attach_optimizer, fully_shard, locate
from mfsdp_hooks.testing.parity import shard_blocks


# ----------------------------------------------------------------- tensor-subclass params
class TaggedTensor(torch.Tensor):
    """A user's tensor subclass: torch keeps its class through ops, the engine cannot."""


def _refusal(rank: int, world: int, kind: str) -> tuple[str, str]:
    model = make_model()
    if kind == "wrapper_subclass":
        model.blocks[1].fc1.weight = nn.Parameter(
            model.blocks[1].fc1.weight.data.as_subclass(TaggedTensor)
        )
        target, root = model.blocks[1], model
    else:  # torchao float8 training, its FSDP float8 all-gather on
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training

        root = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 32))
        config = Float8LinearConfig(enable_fsdp_float8_all_gather=True)
        convert_to_float8_training(root, config=config)
        target = root
    try:
        if target is not root:
            for block in model.blocks:
                fully_shard(block)
        fully_shard(root)
    except NotImplementedError as error:
        return type(error).__name__, str(error)
    return "wrapped", ""


@pytest.mark.parametrize("kind", ["wrapper_subclass", "torchao_float8"])
def test_tensor_subclass_parameters_are_refused_on_every_rank(kind: str) -> None:
    if kind == "torchao_float8" and importlib.util.find_spec("torchao") is None:
        pytest.skip("torchao is not installed (the noxfile's test sessions install it)")
    outcomes = run_distributed(_refusal, 2, kind, timeout=60)
    assert outcomes[0] == outcomes[1], outcomes
    kind_name, message = outcomes[0]
    assert kind_name == "NotImplementedError", message
    if kind == "wrapper_subclass":
        assert "'fc1.weight' (test_hooks_reliability.TaggedTensor)" in message, message
    else:
        assert "'0.weight'" in message and "'2.weight'" in message, message
        assert "WeightWithDynamicFloat8CastTensor" in message, message


# ----------------------------------------------------------------- ranks that disagree
def _disagreeing(rank: int, world: int, what: str) -> None:
    model = make_model(n_blocks=3)
    if what == "model" and rank == 1:  # one block fewer: the same last block, wrapped first
        del model.blocks[1]
    if what == "model":
        model.blocks[0].fc1 = nn.Linear(15, 7 + rank)  # rank 1 builds a wider layer
        model.blocks[0].fc2 = nn.Linear(7 + rank, 15)
    units: list[Any] = [Block] if what != "fsdp_unit_modules" or rank == 0 else []
    strategy = 3 if what != "strategy" or rank == 0 else 2
    FSDPRootWrapper(
        model, fsdp_unit_modules=units, options=ShardingOptions(zero_dp_strategy=strategy)
    )


@pytest.mark.parametrize(
    ("what", "words"),
    [
        (
            "model",
            [
                "fully_shard: the ranks of group dp_shard disagree on\n"
                "  parameters: rank 0: 6 parameters, 262 elements, digest"
            ],
        ),
        ("fsdp_unit_modules", ["module: rank 0: Block; rank 1: ToyModel"]),
        ("strategy", ["strategy: rank 0: <ShardingStrategy.OPTIM_GRADS_PARAMS"]),
    ],
)
def test_ranks_that_disagree_fail_together_at_wrap_time(what: str, words: list[str]) -> None:
    outcomes = run_distributed_outcomes(_disagreeing, 2, what, timeout=60)
    messages = []
    for outcome in outcomes:
        assert outcome.error is not None, f"rank {outcome.rank} wrapped a mismatched model"
        assert isinstance(outcome.error.exception, RankMismatchError), outcome.error
        messages.append(str(outcome.error.exception))
    assert messages[0] == messages[1]
    for word in words:
        assert word in messages[0], messages[0]


# ----------------------------------------------------------------- non-finite gradients
def _local(param: torch.Tensor) -> torch.Tensor:
    return param.to_local() if isinstance(param, DTensor) else param


def _unsharded(param: torch.Tensor) -> torch.Tensor:
    where = locate(param)
    assert where is not None
    return where.group.unsharded_params[where.index]


def _nan_stops_the_step(rank: int, world: int, strategy: int, bad: float, sync: bool) -> str:
    model = make_model()
    wrapped = FSDPRootWrapper(
        model,
        fsdp_unit_modules=[Block],
        options=ShardingOptions(
            zero_dp_strategy=strategy,
            report_nan_in_param_grad=True,
            sync_model_each_microbatch=sync,
        ),
    )
    # The parameter forward and backward use (the original one is left with stale values).
    poisoned = _unsharded(model.blocks[2].fc2.bias)
    optimizer = attach_optimizer(torch.optim.AdamW(trainable(wrapped), lr=1e-2))
    # The sharded weights the optimizer steps (the module shows unsharded ones mid-step).
    stepped = [p for group in optimizer.param_groups for p in group["params"]]
    batches = make_batches(2, 4)
    for step, (tokens, targets) in enumerate(batches):
        if step == 1 and rank == 1:
            poisoned.register_hook(lambda g: g * bad)
        before = [_local(p).clone() for p in stepped]
        try:
            out = wrapped(local_slice(tokens, rank, world))
            loss_fn(out, local_slice(targets, rank, world)).backward()
            optimizer.step()
        except RuntimeError as error:
            after = [_local(p) for p in stepped]
            unchanged = all(torch.equal(a, b) for a, b in zip(after, before, strict=True))
            return f"step {step}, weights unchanged={unchanged}: {error}"
        optimizer.zero_grad()
    return "no error"


@pytest.mark.parametrize("strategy", [0, 1, 2, 3])
@pytest.mark.parametrize(("bad", "sync"), [(float("nan"), True), (float("inf"), False)])
def test_a_non_finite_gradient_is_named_on_every_rank_before_the_step(
    strategy: int, bad: float, sync: bool
) -> None:
    for message in run_distributed(_nan_stops_the_step, 2, strategy, bad, sync, timeout=60):
        assert message.startswith("step 1, weights unchanged=True: "), message
        assert "NaN or Inf in the reduced gradient of ['blocks.2.fc2.bias']" in message, message


# ----------------------------------------------------------------- wrapped classes
def _wrapped_classes(rank: int, world: int) -> list[str]:
    import copy

    model = make_model()
    shard_blocks(model)
    classes = {type(block) for block in model.blocks}
    assert len(classes) == 1, classes  # one FSDPBlock class, not one per call
    assert type(model).__name__ == "FSDPToyModel"
    messages = []
    for target in (model, model.blocks[0]):
        try:
            copy.deepcopy(target)
        except TypeError as error:
            messages.append(str(error))
    return messages


def test_wrapped_classes_are_shared_and_refuse_deepcopy() -> None:
    messages = run_distributed(_wrapped_classes, 1, timeout=60)[0]
    assert len(messages) == 2, messages
    assert "copy.deepcopy of a fully-sharded FSDPToyModel is not supported" in messages[0]
    assert "load a state dict" in messages[1]


# ----------------------------------------------------------------- root-level options
def _root_option_on_a_block(rank: int, world: int) -> str:
    model = make_model()
    for block in model.blocks:
        fully_shard(block, prefetch_depth=2)
    fully_shard(model)  # the root: prefetch_depth=1
    tokens, _ = make_batches(1, 4)[0]
    try:
        model(local_slice(tokens, rank, world))
    except ValueError as error:
        return str(error)
    return "the block's prefetch_depth was ignored"


def test_a_root_level_option_given_to_a_non_root_unit_is_refused() -> None:
    for message in run_distributed(_root_option_on_a_block, 2, timeout=60):
        assert message.startswith(
            "prefetch_depth=2 was given to fully_shard(Block), but prefetch_depth is a "
            "root-level option and the root fully_shard(ToyModel) has prefetch_depth=1"
        ), message


# ----------------------------------------------------------------- the unit's state machine
def test_the_unit_state_machine_refuses_moves_the_lifecycle_never_makes() -> None:
    from mfsdp_hooks.runtime.training_state import TrainingState as S

    legal = [
        (S.IDLE, S.FORWARD),
        (S.FORWARD, S.IDLE),
        (S.IDLE, S.PRE_BACKWARD),
        (S.PRE_BACKWARD, S.PRE_BACKWARD),
        (S.PRE_BACKWARD, S.POST_BACKWARD),
        (S.IDLE, S.POST_BACKWARD),
        (S.POST_BACKWARD, S.IDLE),
    ]
    for start, end in legal:
        start.check_move(end, "Block")
    for start, end in [
        (S.POST_BACKWARD, S.FORWARD),
        (S.POST_BACKWARD, S.PRE_BACKWARD),
        (S.PRE_BACKWARD, S.FORWARD),
        (S.FORWARD, S.POST_BACKWARD),
    ]:
        with pytest.raises(RuntimeError, match=f"Block: illegal state change {start.name}"):
            start.check_move(end, "Block")


# ----------------------------------------------------------------- attached optimizers
def _attached_optimizer(rank: int, world: int) -> dict[str, Any]:
    import copy

    options = ShardingOptions(sync_model_each_microbatch=False)
    model = FSDPRootWrapper(make_model(), fsdp_unit_modules=[Block], options=options)
    optimizer = attach_optimizer(torch.optim.AdamW(trainable(model), lr=1e-2))
    calls = {"pre": 0, "post": 0}
    optimizer.register_step_pre_hook(lambda *_: calls.__setitem__("pre", calls["pre"] + 1))
    optimizer.register_step_post_hook(lambda *_: calls.__setitem__("post", calls["post"] + 1))
    for step, (tokens, targets) in enumerate(make_batches(3, 4)):
        if step == 1:  # loading a state dict makes torch re-wrap the class's step
            optimizer.load_state_dict(copy.deepcopy(optimizer.state_dict()))
        loss_fn(
            model(local_slice(tokens, rank, world)), local_slice(targets, rank, world)
        ).backward()
        optimizer.step()
        optimizer.zero_grad()
    scheduled = torch.optim.AdamW(trainable(model), lr=1e-2)
    torch.optim.lr_scheduler.StepLR(scheduled, 2)  # wraps the class's step on the instance
    replaced = torch.optim.AdamW(trainable(model), lr=1e-2)
    replaced.step = lambda *_, **__: None  # type: ignore[method-assign]
    refused = []
    for late, contiguous_step in ((replaced, None), (scheduled, True)):
        try:
            attach_optimizer(late, contiguous_step=contiguous_step)
            refused.append("")
        except ValueError as error:
            refused.append(str(error))
    return {
        "calls": calls,
        "class": type(optimizer).__name__,
        "same_class": type(attach_optimizer(torch.optim.AdamW(trainable(model))))
        is type(optimizer),
        "refused": refused,
    }


def test_an_attached_optimizer_runs_step_hooks_once_and_refuses_a_replaced_step() -> None:
    out = run_distributed(_attached_optimizer, 2, timeout=60)[0]
    assert out["calls"] == {"pre": 3, "post": 3}, out
    assert out["class"] == "FSDPAdamW" and out["same_class"], out
    replaced, contiguous = out["refused"]
    assert "call attach_optimizer / fully_shard_optimizer before replacing step" in replaced, out
    assert contiguous.startswith("contiguous_step=True: the optimizer's step was wrapped"), out
