"""Checkpoints other writers named: torch FSDP2 (``get_state_dict``, or plain positional
``optimizer.state_dict()``), with and without a ``module.`` wrapper prefix (the prefixed
positional one is how NVIDIA megatron-fsdp's README snippet names its checkpoints), loaded by
both of our APIs on another world size; and ours saved for FSDP2 to load."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from checkpoint_models import (
    assert_rel,
    make_batches,
    make_model,
    make_optimizer,
    shard,
    train,
)
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

import mfsdp_checkpoint as mc
from mfsdp_checkpoint.cli import main
from mfsdp_checkpoint.errors import StateDictMismatchError
from mfsdp_checkpoint.positions import PositionEvidence, derive_positions
from mfsdp_collectives.testing import run_distributed
from mfsdp_hooks.testing import train_single_process
from mfsdp_hooks.testing.parity import shard_blocks

SAVE_AT, MORE = 4, 4


class Wrapper(nn.Module):
    """Names every parameter ``module.*``, as a MegatronFSDP wrapper does."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.module = module

    def forward(self, *args: Any) -> Any:
        return self.module(*args)


def _fsdp2_model(wrap: bool) -> tuple[nn.Module, nn.Module]:
    inner = make_model()
    shard_blocks(inner, "fsdp2")
    return (Wrapper(inner) if wrap else inner), inner


def _fsdp2_state(model: nn.Module, optimizer: torch.optim.Optimizer, style: str) -> Any:
    if style == "get_state_dict":
        return {
            "model": get_model_state_dict(model),
            "optimizer": get_optimizer_state_dict(model, optimizer),
        }
    return {"model": model.state_dict(), "optimizer": optimizer.state_dict()}  # positional


def _optimizer(model: nn.Module, kind: str) -> torch.optim.Optimizer:
    if kind == "adamw":
        return make_optimizer(model)
    params = [p for p in model.parameters() if p.requires_grad]
    return torch.optim.SGD(params, lr=0.05, momentum=0.9)


def _one_process_curve(kind: str) -> list[float]:
    model = make_model()
    losses = train_single_process(model, _optimizer(model, kind), make_batches(SAVE_AT + MORE))
    return losses[SAVE_AT:]


def _fsdp2_writes(
    rank: int, world: int, path: str, style: str, wrap: bool, kind: str = "adamw"
) -> list[float]:
    """FSDP2 trains, saves, and trains on: the curve a resumed job must continue."""
    model, inner = _fsdp2_model(wrap)
    optimizer = _optimizer(model, kind)
    batches = make_batches(SAVE_AT + MORE)
    train(inner, optimizer, batches[:SAVE_AT], rank, world)
    dcp.save(_fsdp2_state(model, optimizer, style), checkpoint_id=path)
    return train(inner, optimizer, batches[SAVE_AT:], rank, world)


class _Messages(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def _we_resume(
    rank: int, world: int, path: str, api: str, kind: str
) -> tuple[list[float], list[str]]:
    model = shard(make_model(seed=77), 3, api=api)
    optimizer = _optimizer(model, kind)
    logger = logging.getLogger("mfsdp_checkpoint")
    handler = _Messages()
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    mc.load_checkpoint(path, model, optimizer)
    logger.removeHandler(handler)
    losses = train(model, optimizer, make_batches(SAVE_AT + MORE)[SAVE_AT:], rank, world)
    return losses, handler.messages


@pytest.mark.parametrize(
    ("style", "wrap", "api", "world", "kind"),
    [
        ("get_state_dict", False, "megatron", 3, "adamw"),  # FSDP2 names into module.*
        ("get_state_dict", False, "per_module", 2, "sgd"),
        ("positional", True, "megatron", 2, "sgd"),  # NVIDIA megatron-fsdp's naming
        ("positional", True, "per_module", 3, "adamw"),
        ("positional", False, "megatron", 3, "adamw"),
    ],
)
def test_foreign_checkpoint_resumes_on_either_api(
    tmp_path: Path, style: str, wrap: bool, api: str, world: int, kind: str
) -> None:
    path = str(tmp_path / "ckpt")
    expected = run_distributed(_fsdp2_writes, 2, path, style, wrap, kind, timeout=180)[0]
    assert_rel(expected, _one_process_curve(kind), 1e-5, "FSDP2 against one process")
    resumed, logged = run_distributed(_we_resume, world, path, api, kind, timeout=180)[0]
    assert_rel(resumed, expected, 1e-5, f"resumed from FSDP2 ({style}, wrapped={wrap})")
    if style == "positional":  # the load records how positions were matched to names
        expected_how = "are this optimizer's parameter order, which is also the model's"
        assert any(expected_how in m for m in logged), logged


def _we_write(rank: int, world: int, path: str, naming: str) -> list[float]:
    model = shard(make_model(), 3)
    optimizer = make_optimizer(model)
    batches = make_batches(SAVE_AT + MORE)
    train(model, optimizer, batches[:SAVE_AT], rank, world)
    mc.save_checkpoint(path, model, optimizer, naming=naming)
    return train(model, optimizer, batches[SAVE_AT:], rank, world)


def _create_state(optimizer: torch.optim.Optimizer) -> None:
    """A fresh torch optimizer's ``state_dict()`` has no state for ``dcp.load`` to fill
    (``get_optimizer_state_dict`` creates it; a positional loader must): one step at lr 0 on
    zero gradients creates it without touching the weights; the load overwrites it."""
    lrs = [group["lr"] for group in optimizer.param_groups]
    for group in optimizer.param_groups:
        group["lr"] = 0.0
        for param in group["params"]:
            param.grad = torch.zeros_like(param)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    for group, lr in zip(optimizer.param_groups, lrs, strict=True):
        group["lr"] = lr


def _fsdp2_resumes(rank: int, world: int, path: str, naming: str) -> list[float]:
    """What an FSDP2 job runs to resume, unchanged: torch's own state-dict API and dcp.load."""
    wrap = naming == "nvidia"
    model, inner = _fsdp2_model(wrap)
    optimizer = make_optimizer(model)
    if naming == "nvidia":
        _create_state(optimizer)
    state = _fsdp2_state(model, optimizer, "get_state_dict" if naming == "fsdp2" else "")
    dcp.load(state, checkpoint_id=path)
    if naming == "fsdp2":
        set_model_state_dict(model, state["model"])
        set_optimizer_state_dict(model, optimizer, state["optimizer"])
    else:
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
    return train(inner, optimizer, make_batches(SAVE_AT + MORE)[SAVE_AT:], rank, world)


@pytest.mark.parametrize("naming", ["fsdp2", "nvidia"])
def test_fsdp2_resumes_from_our_checkpoint_saved_for_it(tmp_path: Path, naming: str) -> None:
    path = str(tmp_path / "ours")
    expected = run_distributed(_we_write, 3, path, naming, timeout=180)[0]
    resumed = run_distributed(_fsdp2_resumes, 2, path, naming, timeout=180)[0]
    assert_rel(resumed, expected, 1e-5, f"FSDP2 resumed from ours (naming={naming})")
    report = mc.describe(path)
    assert report["naming"]["model_prefix"] == ("module." if naming == "nvidia" else "")


def _resume_with(rank: int, world: int, path: str, optimizer_fn: Any) -> str:
    model = shard(make_model(seed=77), 3)
    optimizer = optimizer_fn(model)
    try:
        mc.load_checkpoint(path, model, optimizer)
    except StateDictMismatchError as error:
        return str(error)
    return "loaded"


def _weights_then_biases(model: nn.Module) -> torch.optim.Optimizer:
    params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    return torch.optim.AdamW(
        [
            {"params": [p for n, p in params if not n.endswith("bias")]},
            {"params": [p for n, p in params if n.endswith("bias")], "weight_decay": 0.0},
        ],
        lr=1e-2,
    )


def _without_first_block(model: nn.Module) -> torch.optim.Optimizer:
    params = [p for n, p in model.named_parameters() if p.requires_grad and "blocks.0." not in n]
    return torch.optim.AdamW(params, lr=1e-2)


def test_positional_state_that_cannot_be_matched_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = str(tmp_path / "ckpt")
    run_distributed(_fsdp2_writes, 2, path, "positional", True, timeout=180)
    assert main(["describe", path]) == 0
    printed = capsys.readouterr().out
    assert "writer:      NVIDIA megatron-fsdp" in printed, printed
    assert "model prefix 'module.', optimizer state by-position" in printed, printed
    fewer = run_distributed(_resume_with, 2, path, _without_first_block, timeout=180)
    assert all("positions cannot be matched" in m for m in fewer), fewer
    regrouped = run_distributed(_resume_with, 2, path, _weights_then_biases, timeout=180)
    assert all("parameter groups hold" in m for m in regrouped), regrouped


def _evidence(ours: list[str], shape_b: tuple[int, ...]) -> PositionEvidence:
    shapes = {"a": (2, 3), "b": shape_b, "c": (5,)}
    written = ["a", "b", "c"]  # the writer's model.parameters() order
    return PositionEvidence(
        our_groups=[ours],
        writer_groups=[[0, 1, 2]],
        model_order=["module.x", *written],  # a buffer the optimizer does not hold
        state_shapes={i: [shapes[name]] for i, name in enumerate(written)},
        param_shapes=shapes,
    )


def test_positions_follow_the_only_order_the_saved_shapes_allow() -> None:
    positions, how = derive_positions(_evidence(["a", "b", "c"], (4,)))
    assert positions == {"a": 0, "b": 1, "c": 2} and "also the model's" in how
    # This optimizer lists a and b the other way round; their shapes say the writer did not.
    positions, how = derive_positions(_evidence(["b", "a", "c"], (4,)))
    assert positions == {"a": 0, "b": 1, "c": 2} and "model.parameters()" in how


def test_positions_that_two_orders_fit_are_refused() -> None:
    with pytest.raises(StateDictMismatchError, match="fits two different parameter orders"):
        derive_positions(_evidence(["b", "a", "c"], (2, 3)))
    shuffled = PositionEvidence([["a", "b"]], [[1, 0]], ["a", "b"], {}, {})
    with pytest.raises(StateDictMismatchError, match="not 0, 1, 2"):
        derive_positions(shuffled)


def _megatron_lm_layout(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """Our state laid out as Megatron-LM's ``--ckpt-format fsdp_dtensor`` saves it with
    TE's ``FusedAdam`` (Megatron-Core's ``DistributedOptimizer.sharded_param_state_fsdp_dtensor``):
    model under ``module.*``, optimizer state under the chunk's deeper ``module.module.*``
    names with no ``step``, every parameter's group fields (and the step) in
    ``param_to_group_meta``, no ``param_groups``; ``checkpoint_version``/``iteration``/``args``
    beside them."""
    ours = mc.named_optimizer_state_dict(model, optimizer)
    (group,) = ours["param_groups"]
    fields = {k: v for k, v in group.items() if k != "params"}
    steps = {int(entry["step"]) for entry in ours["state"].values()}
    (step,) = steps
    return {
        "model": model.state_dict(),
        "optimizer": {
            "state": {
                f"module.{name}": {k: v for k, v in entry.items() if k != "step"}
                for name, entry in ours["state"].items()
            },
            "param_to_group_meta": {
                f"module.{name}": {**fields, "step": step} for name in group["params"]
            },
        },
        "checkpoint_version": 3.0,
        "iteration": SAVE_AT,
        "args": {"ckpt_format": "fsdp_dtensor"},
    }


def _megatron_lm_writes(rank: int, world: int, path: str, writer: str) -> list[float]:
    """Train, save as Megatron-LM lays fsdp_dtensor out (by hand, or ``save_checkpoint(...,
    naming="megatron")``), train on: the curve a resumed job must continue."""
    model = shard(make_model(), 3)
    optimizer = make_optimizer(model)
    batches = make_batches(SAVE_AT + MORE)
    train(model, optimizer, batches[:SAVE_AT], rank, world)
    if writer == "megatron-lm":
        dcp.save(_megatron_lm_layout(model, optimizer), checkpoint_id=path)
    else:
        mc.save_checkpoint(path, model, optimizer, naming="megatron")
    return train(model, optimizer, batches[SAVE_AT:], rank, world)


def _resume_from_megatron_lm(rank: int, world: int, path: str, api: str) -> list[float]:
    model = shard(make_model(seed=5), 2, api=api)
    optimizer = make_optimizer(model)
    for group in optimizer.param_groups:
        group["lr"] = 0.5  # the checkpoint's group fields must replace these
    mc.load_checkpoint(path, model, optimizer)
    return train(model, optimizer, make_batches(SAVE_AT + MORE)[SAVE_AT:], rank, world)


@pytest.mark.parametrize("writer", ["megatron-lm", "save_checkpoint"])
def test_megatron_fsdp_dtensor_checkpoint_resumes_model_and_optimizer(
    tmp_path: Path, writer: str
) -> None:
    """Megatron-LM's fsdp_dtensor layout (optimizer state by deeper names, group fields and
    step per parameter in param_to_group_meta) resumes on both APIs at another world size and
    strategy, continuing the writer's curve; ours saved with naming="megatron" is that layout."""
    path = str(tmp_path / "fsdp_dtensor")
    expected = run_distributed(_megatron_lm_writes, 2, path, writer, timeout=180)[0]
    assert mc.describe(path)["writer"] == "Megatron-LM / Megatron-Bridge fsdp_dtensor"
    for api in ("megatron", "per_module"):
        resumed = run_distributed(_resume_from_megatron_lm, 3, path, api, timeout=180)[0]
        assert_rel(resumed, expected, 1e-5, f"{api} resumed from {writer}'s fsdp_dtensor")
