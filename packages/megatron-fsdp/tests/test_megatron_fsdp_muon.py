"""``megatron_fsdp.Muon`` trains sharded as ``torch.optim.Muon`` (+ AdamW) trains one process.

Issue 51's table, re-run: torch's Muon on each rank's rows is 5e-2 off one process; ours,
through every entry point, at 2 and 4 ranks, under ZeRO-1/2/3 and HSDP/HFSDP, is within
1e-5 over 10 steps of one process whose gradient is accumulated over as many micro-batches
(the order the ranks' gradients are summed in), and each step equals torch's bit for bit on
the gradients the sharded run reduced. Against a whole batch the defaults stay within 1e-5
too; with some options a gradient's last bit, summed in another order, flips a bfloat16
rounding of the orthogonalisation and the curves part by ~1e-3: one process does the same
against itself (``test_one_process_parts_from_itself_when_the_sum_is_reordered``).
Muon steps the blocks' matrices; a ``use_muon=False`` group steps the rest as AdamW, as Muon
users configure it. ``torch.optim.Muon`` handed to the engine becomes ours. A DCP checkpoint
saved at 2 ranks resumes at 4 on the same curve.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from test_megatron_fsdp_checkpoint import _hybrid_args
from torch import nn
from torch.distributed.tensor import DTensor
from toy_entry_points import plain_name, shard_toy

import megatron_fsdp
from mfsdp_collectives.testing import run_distributed
from mfsdp_hooks.testing import (
    local_slice,
    loss_fn,
    make_batches,
    make_model,
    train_data_parallel,
)

STEPS = 10
MUON_LR, ADAMW_LR = 2e-2, 1e-2
_FULL_ONLY = pytest.mark.skipif(
    os.environ.get("MFSDP_FULL_MATRIX") != "1", reason="MFSDP_FULL_MATRIX=1 only"
)


def _full(entry: str, world: int) -> Any:
    return pytest.param(entry, world, marks=_FULL_ONLY)


def _is_hidden_matrix(name: str, param: torch.Tensor) -> bool:
    return "blocks." in name and param.ndim == 2 and param.requires_grad


def _split(model: nn.Module) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    hidden = [p for n, p in named if _is_hidden_matrix(n, p)]
    return hidden, [p for n, p in named if not _is_hidden_matrix(n, p)]


def ours(model: nn.Module, **muon_args: Any) -> torch.optim.Optimizer:
    hidden, rest = _split(model)
    groups = [{"params": hidden}, {"params": rest, "use_muon": False, "lr": ADAMW_LR}]
    return megatron_fsdp.Muon(groups, lr=MUON_LR, **muon_args)


def _one_process(
    batches: list[Any], torch_muon_only: bool, parts: int, **muon_args: Any
) -> nn.Module:
    """The ground truth: torch's Muon on the blocks' matrices, torch's AdamW on the rest;
    each batch's gradient accumulated over ``parts`` micro-batches."""
    model = make_model()
    hidden, rest = _split(model)
    optimizers: list[torch.optim.Optimizer] = [torch.optim.Muon(hidden, lr=MUON_LR, **muon_args)]
    if not torch_muon_only:
        optimizers.append(torch.optim.AdamW(rest, lr=ADAMW_LR))
    for tokens, targets in batches:
        losses = [
            loss_fn(model(local_slice(tokens, i, parts)), local_slice(targets, i, parts))
            for i in range(parts)
        ]
        (sum(losses) / parts).backward()
        for optimizer in optimizers:
            optimizer.step()
            optimizer.zero_grad()
    return model


def _full_values(wrapped: nn.Module, grads: bool) -> dict[str, torch.Tensor]:
    """Every trainable parameter's whole value (or gradient), by plain name (collective)."""
    values = {}
    for name, param in wrapped.named_parameters():
        value = param.grad if grads else param
        if not param.requires_grad or value is None:
            continue
        full = value.full_tensor() if isinstance(value, DTensor) else value
        values[plain_name(name)] = full.detach().clone()
    return values


class _Shadow:
    """One process's model and torch's optimizers, fed each step the gradients the sharded
    run reduced: given the same inputs, our step must give torch's bit for bit."""

    def __init__(self, wrapped: nn.Module, torch_muon_only: bool, muon_args: dict[str, Any]):
        self.model = make_model()
        with torch.no_grad():
            for name, value in _full_values(wrapped, grads=False).items():
                self.model.get_parameter(name).copy_(value)
        hidden, rest = _split(self.model)
        self.optimizers: list[torch.optim.Optimizer] = [
            torch.optim.Muon(hidden, lr=MUON_LR, **muon_args)
        ]
        if not torch_muon_only:
            self.optimizers.append(torch.optim.AdamW(rest, lr=ADAMW_LR))

    def step(self, grads: dict[str, torch.Tensor]) -> None:
        for name, param in self.model.named_parameters():
            param.grad = grads.get(name)
        for optimizer in self.optimizers:
            optimizer.step()
            optimizer.zero_grad()

    def mismatches(self, wrapped: nn.Module) -> list[str]:
        mine = _full_values(wrapped, grads=False)
        return [
            n for n, p in self.model.named_parameters() if n in mine and not torch.equal(mine[n], p)
        ]


def _worst_difference(
    rank: int, world: int, entry: str, muon_args: dict[str, Any], seed_kwargs: dict[str, Any]
) -> tuple[float, list[str]]:
    """After 10 steps: max over parameters of max |ours - one process| / max |one process|,
    and the parameters whose step differed in any bit from torch's on the same gradients
    (``entry`` ``seed_torch_muon``: torch's Muon handed to the seed API)."""
    torch_muon_only = entry == "seed_torch_muon"

    def build(model: nn.Module) -> torch.optim.Optimizer:
        if torch_muon_only:
            return torch.optim.Muon(_split(model)[0], lr=MUON_LR, **muon_args)
        return ours(model, **muon_args)

    batches = make_batches(STEPS)
    expected = _one_process(batches, torch_muon_only, world, **muon_args)
    sharded_by = "seed" if torch_muon_only else entry
    wrapped, optimizer = shard_toy(sharded_by, world, build, **seed_kwargs)
    if torch_muon_only:
        assert isinstance(optimizer, megatron_fsdp.Muon), type(optimizer).__mro__
    shadow = _Shadow(wrapped, torch_muon_only, muon_args)
    differed: list[str] = []
    for step, (tokens, targets) in enumerate(batches):
        loss = loss_fn(wrapped(local_slice(tokens, rank, world)), local_slice(targets, rank, world))
        loss.backward()
        grads = _full_values(wrapped, grads=True)
        optimizer.step()
        optimizer.zero_grad()
        shadow.step(grads)
        differed += [f"step {step}: {name}" for name in shadow.mismatches(wrapped)]
    mine = _full_values(wrapped, grads=False)
    worst = 0.0
    for name, param in expected.named_parameters():
        if name in mine:
            worst = max(worst, float((mine[name] - param).abs().max() / param.abs().max()))
    return worst, differed


def _check(results: list[tuple[float, list[str]]]) -> None:
    for worst, differed in results:
        assert not differed, differed[:5]
        assert worst <= 1e-5, worst


@pytest.mark.parametrize(
    ("entry", "world"),
    [
        ("seed", 2),
        ("per_module", 4),
        ("mcore", 2),
        ("seed_torch_muon", 2),
        _full("seed", 4),
        _full("fully_shard_optimizer", 2),
        _full("fully_shard_optimizer", 4),
        _full("class", 2),
        _full("class", 4),
        _full("per_module", 2),
        _full("per_module_attach", 2),
        _full("mcore", 4),
        _full("seed_torch_muon", 4),
    ],
)
def test_every_entry_point_trains_as_one_process(entry: str, world: int) -> None:
    _check(run_distributed(_worst_difference, world, entry, {}, {}, timeout=180))


@pytest.mark.parametrize(
    ("zero", "muon_args"),
    [
        (1, {"nesterov": False, "adjust_lr_fn": "match_rms_adamw"}),
        (2, {"weight_decay": 0.0}),
        pytest.param(3, {"nesterov": False, "weight_decay": 0.05}, marks=_FULL_ONLY),
        pytest.param(2, {"adjust_lr_fn": "original", "momentum": 0.9}, marks=_FULL_ONLY),
    ],
)
def test_every_zero_strategy_and_muon_option(zero: int, muon_args: dict[str, Any]) -> None:
    results = run_distributed(
        _worst_difference,
        2,
        "fully_shard_optimizer",
        muon_args,
        {"zero_dp_strategy": zero},
        timeout=180,
    )
    _check(results)


def _hybrid_worker(rank: int, world: int, hybrid: str) -> tuple[float, list[str]]:
    return _worst_difference(rank, world, "fully_shard_optimizer", {}, _hybrid_args(hybrid))


@pytest.mark.parametrize("hybrid", ["hsdp", pytest.param("hfsdp", marks=_FULL_ONLY)])
def test_hsdp_orthogonalises_within_the_shard_group(hybrid: str) -> None:
    """HSDP: each replica's shard group (2 ranks) does the work; HFSDP: the optimizer's
    4-rank group."""
    _check(run_distributed(_hybrid_worker, 4, hybrid, timeout=240))


def test_one_process_parts_from_itself_when_the_sum_is_reordered() -> None:
    """Why the reference accumulates: torch's Muon alone, whole batch against two halves."""
    batches = make_batches(STEPS)
    args = {"nesterov": False, "adjust_lr_fn": "match_rms_adamw"}
    whole = dict(_one_process(batches, False, 1, **args).named_parameters())
    halves = dict(_one_process(batches, False, 2, **args).named_parameters())
    drift = max(float((halves[n] - p).abs().max() / p.abs().max()) for n, p in whole.items())
    assert drift > 1e-4, drift
    defaults_whole = dict(_one_process(batches, False, 1).named_parameters())
    defaults_halves = dict(_one_process(batches, False, 2).named_parameters())
    assert (
        max(
            float((defaults_halves[n] - p).abs().max() / p.abs().max())
            for n, p in defaults_whole.items()
        )
        <= 1e-5
    )


# ---------------------------------------------------------------- DCP, 2 ranks -> 4 ranks
def _save(rank: int, world: int, path: str) -> list[float]:
    batches = make_batches(8)
    model, optimizer = shard_toy("fully_shard_optimizer", world, ours)
    losses = train_data_parallel(model, optimizer, batches[:4], rank, world, global_mean=True)
    dcp.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, checkpoint_id=path)
    return losses + train_data_parallel(
        model, optimizer, batches[4:], rank, world, global_mean=True
    )


def _resume(rank: int, world: int, path: str) -> tuple[list[float], int]:
    # Another init: only the load makes it right.
    model, optimizer = shard_toy("fully_shard_optimizer", world, ours, model_seed=123)
    state = {"model": model.state_dict(), "optimizer": optimizer.state_dict()}
    dcp.load(state_dict=state, checkpoint_id=path)
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    # A rank holding no rows of a matrix loads nothing for it (its state comes at the step).
    restored = [
        entry["momentum_buffer"]
        for entry in optimizer.state.values()
        if "momentum_buffer" in entry and entry["momentum_buffer"].to_local().numel()
    ]
    batches = make_batches(8)[4:]
    losses = train_data_parallel(model, optimizer, batches, rank, world, global_mean=True)
    return losses, len(restored)


def test_a_checkpoint_saved_at_two_ranks_resumes_at_four_on_the_same_curve(
    tmp_path: Path,
) -> None:
    path = str(tmp_path / "muon")
    straight = run_distributed(_save, 2, path, timeout=180)[0]
    results = run_distributed(_resume, 4, path, timeout=180)
    assert sum(restored for _, restored in results) >= 6  # every block matrix's momentum
    resumed = results[0][0]
    for step, (want, got) in enumerate(zip(straight[4:], resumed, strict=True), start=4):
        assert abs(got - want) <= 1e-5 * abs(want), (step, want, got)


# ------------------------------------------------- torch's state-dict helpers, per-module API
def _helpers_round_trip(rank: int, world: int, full: bool) -> tuple[list[float], list[float]]:
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    batches = make_batches(8)
    model, optimizer = shard_toy("per_module", world, ours)
    straight = train_data_parallel(model, optimizer, batches, rank, world, global_mean=True)
    model, optimizer = shard_toy("per_module", world, ours)
    train_data_parallel(model, optimizer, batches[:4], rank, world, global_mean=True)
    out = StateDictOptions(full_state_dict=full, cpu_offload=full)  # full: on rank 0 only
    weights = get_model_state_dict(model, options=out)
    moments = get_optimizer_state_dict(model, optimizer, options=out)
    # Another init: only the load makes it right.
    fresh, fresh_optimizer = shard_toy("per_module", world, ours, model_seed=123)
    into = StateDictOptions(full_state_dict=full, broadcast_from_rank0=full)
    set_model_state_dict(fresh, weights, options=into)
    set_optimizer_state_dict(fresh, fresh_optimizer, moments, options=into)
    resumed = train_data_parallel(
        fresh, fresh_optimizer, batches[4:], rank, world, global_mean=True
    )
    return straight[4:], resumed


@pytest.mark.parametrize("full", [False, pytest.param(True, marks=_FULL_ONLY)])
def test_torchs_state_dict_helpers_carry_the_momentum(full: bool) -> None:
    straight, resumed = run_distributed(_helpers_round_trip, 2, full, timeout=180)[0]
    for want, got in zip(straight, resumed, strict=True):
        assert abs(got - want) <= 1e-5 * abs(want), (straight, resumed)
