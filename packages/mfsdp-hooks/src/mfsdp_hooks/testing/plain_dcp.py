"""Resuming through plain ``torch.distributed.checkpoint``, written as FSDP2 users write it.

``dcp.save({"model": model.state_dict(), "optim": optimizer.state_dict()})``, then a fresh
model and optimizer, ``dcp.load`` into their state dicts and ``load_state_dict``: the steps
after the load must be those of an uninterrupted run, and torch's ``dcp_to_torch_save`` must
write the full weights. The model's units split mid-parameter over 2 ranks (a 32x32 weight
and its bias: 17 rows and none of the bias on rank 0, 15 rows and the bias on rank 1), which
is not ``torch.chunk``'s 16/16, so a checkpoint that takes ``Shard(0)`` at its word puts rows
in the wrong place or fails to load an empty piece.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save
from torch.distributed.tensor import DTensor

from mfsdp_hooks.testing import assert_close_rel
from mfsdp_hooks.testing.tp import full_value

__all__ = ["DCPBlock", "DCPModel", "Wrap", "check_plain_dcp_resume"]

WIDTH, OUT, BATCH, STEPS, SAVE_AT = 32, 3, 8, 10, 5

Wrap = Callable[[nn.Module], tuple[nn.Module, torch.optim.Optimizer]]
"""Shard a fresh model and build its optimizer (the entry point under test)."""


class DCPBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.linear(x))


class DCPModel(nn.Module):
    """Four 32-wide blocks (one unit each) and a 3-wide head the root owns."""

    def __init__(self, blocks: int = 4) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(DCPBlock() for _ in range(blocks))
        self.head = nn.Linear(WIDTH, OUT)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        out: torch.Tensor = self.head(x)
        return out


def _batches(world: int, rank: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(5)
    out = []
    for _ in range(STEPS):
        x = torch.randn(BATCH, WIDTH, generator=generator)
        y = torch.randn(BATCH, OUT, generator=generator)
        per = BATCH // world
        out.append((x[rank * per : (rank + 1) * per], y[rank * per : (rank + 1) * per]))
    return out


def _train(model: nn.Module, optimizer: torch.optim.Optimizer, batches: list[Any]) -> list[float]:
    losses = []
    for x, y in batches:
        loss = F.mse_loss(model(x), y)
        loss.backward()  # type: ignore[no-untyped-call]
        optimizer.step()
        optimizer.zero_grad()
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses.append(total.item() / dist.get_world_size())
    return losses


def _full_weights(model: nn.Module) -> dict[str, torch.Tensor]:
    return {name: full_value(p.detach()).clone() for name, p in model.named_parameters()}


def _assert_close(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    assert_close_rel(actual, expected, 1e-6, what)


def _model(seed: int) -> DCPModel:
    torch.manual_seed(seed)
    return DCPModel()


def _init_state(optimizer: torch.optim.Optimizer) -> None:
    """Give a fresh optimizer state to load into, as torch's ``get_state_dict`` does
    (``_init_optim_state``): one step on zero gradients with a learning rate of 0."""
    if optimizer.state:
        return
    lrs = []
    for group in optimizer.param_groups:
        lrs.append(group["lr"])
        group["lr"] = 0.0
        for param in group["params"]:
            param.grad = torch.zeros_like(param)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    for group, lr in zip(optimizer.param_groups, lrs, strict=True):
        group["lr"] = lr


def check_plain_dcp_resume(
    rank: int,
    world: int,
    path: str,
    wrap: Wrap,
    *,
    model_load_state_dict: bool = True,
    init_state: bool = True,
) -> int:
    """Save at step 5 through plain DCP, resume a fresh model, compare with 10 straight steps.

    Without ``model_load_state_dict`` the model is resumed by ``dcp.load`` alone (in place, as
    into FSDP2's sharded parameters); the optimizer always gets ``load_state_dict``.
    ``init_state``: give the fresh optimizer state to load into first (torch's
    ``optimizer.state_dict()`` of one that never stepped has none; not needed where
    ``mfsdp_checkpoint.enable_dcp`` adds placeholders). Returns how many model state-dict
    tensors had an empty local piece on this rank (the case that broke).
    """
    batches = _batches(world, rank)
    straight, straight_opt = wrap(_model(0))
    want_losses = _train(straight, straight_opt, batches)
    want_weights = _full_weights(straight)

    model, optimizer = wrap(_model(0))
    _train(model, optimizer, batches[:SAVE_AT])
    saved_weights = _full_weights(model)
    state = {"model": model.state_dict(), "optim": optimizer.state_dict()}
    empty = sum(
        1
        for value in state["model"].values()
        if isinstance(value, DTensor) and value.to_local().numel() == 0
    )
    saved_state = {  # the optimizer state's full tensors (collective)
        (key, field): full_value(value).clone()
        for key, entry in state["optim"]["state"].items()
        for field, value in entry.items()
        if isinstance(value, torch.Tensor)
    }
    dcp_save(state, checkpoint_id=path)

    fresh, fresh_opt = wrap(_model(1))  # another init: only the load can make it right
    if init_state:
        _init_state(fresh_opt)
    loaded = {"model": fresh.state_dict(), "optim": fresh_opt.state_dict()}
    dcp_load(loaded, checkpoint_id=path)
    if model_load_state_dict:
        fresh.load_state_dict(loaded["model"])
    fresh_opt.load_state_dict(loaded["optim"])
    for name, value in _full_weights(fresh).items():
        _assert_close(value, saved_weights[name], f"{name} right after the load")
    losses = _train(fresh, fresh_opt, batches[SAVE_AT:])
    for step, (got, want) in enumerate(zip(losses, want_losses[SAVE_AT:], strict=True)):
        assert abs(got - want) <= 1e-6 * abs(want), f"loss {SAVE_AT + step}: {got} != {want}"
    for name, value in _full_weights(fresh).items():
        _assert_close(value, want_weights[name], f"{name} after {STEPS} steps")

    dist.barrier()
    if rank == 0:
        single = Path(path) / "single.pt"
        dcp_to_torch_save(path, single)
        converted = torch.load(single, weights_only=False)
        for name, value in saved_weights.items():
            _assert_close(converted["model"][name], value, f"dcp_to_torch_save model.{name}")
        for (key, field), value in saved_state.items():
            got = converted["optim"]["state"][str(key)][field]  # DCP keys are strings
            _assert_close(got, value, f"dcp_to_torch_save optim.state.{key}.{field}")
    dist.barrier()
    return empty
