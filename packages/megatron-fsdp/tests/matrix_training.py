"""A matrix cell's training step on the wrapped model, and the one-process reference run it
is compared with (``reference_run``, ``assert_parity``)."""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator
from typing import Any

import ecosystem_cases
import torch
import torch.distributed as dist
from matrix_builds import Built, adamw
from matrix_columns import (
    STEPS,
    batch_loss,
    eval_batch,
    family,
    global_batch,
    micro_batches,
    shares_in_reference,
)
from matrix_layouts import Layout, local_share
from torch import nn

from mfsdp_checkpoint import gather_full_state_dict
from mfsdp_hooks.testing import make_model
from mfsdp_hooks.testing.moe import NUM_EXPERTS, moe_model
from mfsdp_hooks.testing.tp import tp_model


def train_step(built: Built, row: str, col: str, step: int, layout: Layout) -> float:
    """One optimizer step on ``step``'s batch; returns the global loss (mean over ranks)."""
    model, optimizer = built.model, built.optimizer
    micro = micro_batches(col)
    x, y = global_batch(col, step)
    if row == "mcore":  # Megatron-Core's order: buffers zeroed before the forward passes
        model.zero_grad_buffer()  # type: ignore[operator]
        optimizer.zero_grad()
    total = torch.zeros(())
    pairs = list(zip(x.chunk(micro), y.chunk(micro), strict=True))
    for index, (mx, my) in enumerate(pairs):
        lx, ly = local_share(mx, my, layout)
        last = index == micro - 1
        with contextlib.nullcontext() if last else model.no_sync():  # type: ignore[operator]
            loss = batch_loss(col, model(lx), ly)
            # Megatron-Core sums the micro-batches' gradients and scale_gradients averages.
            (loss if row == "mcore" else loss / micro).backward()
        total += loss.detach().float() / micro
    if row == "mcore":
        model.finish_grad_sync(force_all_reduce=False)  # type: ignore[operator]
        if micro > 1:
            model.scale_gradients(1 / micro)  # type: ignore[operator]
        _check_decoupled(built, col)
        optimizer.step()
        model.param_and_grad_buffer.copy_main_weights_to_model_weights()  # type: ignore[union-attr]
        model.start_param_sync()  # type: ignore[operator]
    else:
        _check_decoupled(built, col)
        optimizer.step()
        optimizer.zero_grad()
    dist.all_reduce(total)
    return total.item() / dist.get_world_size()


def eval_loss(built: Built, col: str, layout: Layout) -> float:
    """train_eval: ``eval()``, a ``no_grad`` forward on the eval batch, ``train()``."""
    built.model.eval()
    with torch.no_grad():
        lx, ly = local_share(*eval_batch(), layout)
        total = batch_loss(col, built.model(lx), ly).detach().float()
    built.model.train()
    dist.all_reduce(total)
    return total.item() / dist.get_world_size()


def _check_decoupled(built: Built, col: str) -> None:
    """decoupled_grad: after a backward, every trainable parameter's reduced gradient is in
    ``decoupled_grad`` and ``.grad`` is None (the engine put nothing there)."""
    if col != "decoupled_grad":
        return
    for name, param in built.model.named_parameters():
        if param.requires_grad:
            assert param.grad is None, f"{name}: .grad was set"
            held = getattr(param, "decoupled_grad", None)
            assert held is not None and held.shape == param.shape, name


def final_weights(built: Built, col: str, layout: Layout) -> dict[str, torch.Tensor]:
    """Every parameter's full value, named as in the one-process model (collective)."""
    kind = family(col)
    if kind in ("toy", "tp"):
        full = gather_full_state_dict(built.state_model, rank0_only=False)
        return {_plain(k): v.float() for k, v in full.items()}
    weights = {}
    for name, param in built.model.named_parameters():
        value = param.full_tensor() if hasattr(param, "full_tensor") else param
        parts = _plain(name).split(".")
        if kind == "ep" and "experts" in parts:  # local expert K is global first + K
            assert layout.expert_mesh is not None
            per_rank = NUM_EXPERTS // layout.expert_mesh["ep"].size()
            first = layout.expert_mesh["ep"].get_local_rank() * per_rank
            at = parts.index("experts") + 1
            parts[at] = str(first + int(parts[at]))
        weights[".".join(parts)] = value.detach().float().clone()
    return weights


def _plain(name: str) -> str:
    while name.startswith("module."):
        name = name.removeprefix("module.")
    return name


# --------------------------------------------------------------------------- reference
@contextlib.contextmanager
def _one_thread() -> Iterator[None]:
    """The ranks run single-threaded; so does the reference (bf16 sums are order-sensitive)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def _reference_model(row: str, col: str) -> nn.Module:
    kind = family(col)
    if kind == "tp":
        return tp_model("mlp", None)
    if kind == "ep":
        return moe_model(None)
    if kind == "float8":
        from mfsdp_te.float8_testing import float8_model

        return float8_model()
    if col in ecosystem_cases.MODEL_COLS:
        return ecosystem_cases.model(col, 0)
    model = make_model(0, checkpoint="non_reentrant" if col == "recompute" else None)
    if col == "bf16" and row == "mcore":  # the bf16 model's weights are the main weights'
        with torch.no_grad():
            for param in model.parameters():
                param.copy_(param.bfloat16().float())
    return model


def reference_run(row: str, col: str) -> dict[str, Any]:
    """The cell's one-process training: losses, eval losses, final weights."""
    with _one_thread():
        master = _reference_model(row, col)
        # bf16: fp32 main weights step; each share runs forward and backward on a bf16
        # copy, its gradient taken to fp32 before the mean over shares (reduce_dtype).
        compute = copy.deepcopy(master).bfloat16() if col == "bf16" else master
        optimizer = ecosystem_cases.optimizer(col, master.parameters()) or adamw(
            master.parameters()
        )
        micro, shares = micro_batches(col), shares_in_reference(col)
        losses, evals = [], []
        for step in range(STEPS):
            x, y = global_batch(col, step)
            total = 0.0
            for mx, my in zip(x.chunk(micro), y.chunk(micro), strict=True):
                for sx, sy in zip(mx.chunk(shares), my.chunk(shares), strict=True):
                    loss = batch_loss(col, compute(sx), sy)
                    (loss / (micro * shares)).backward()
                    total += loss.item() / (micro * shares)
                    if compute is not master:
                        _bf16_grads_to_master(compute, master)
            optimizer.step()
            optimizer.zero_grad()
            if compute is not master:
                _master_to_compute(master, compute)
            losses.append(total)
            if col == "train_eval":
                with torch.no_grad():
                    evals.append(batch_loss(col, master(eval_batch()[0]), eval_batch()[1]).item())
        weights = {k: v.detach().float().clone() for k, v in _reference_state(master, col).items()}
    return {"losses": losses, "evals": evals, "weights": weights}


def _bf16_grads_to_master(compute: nn.Module, master: nn.Module) -> None:
    for low, high in zip(compute.parameters(), master.parameters(), strict=True):
        if low.grad is not None:
            grad = low.grad.float()
            high.grad = grad if high.grad is None else high.grad + grad
            low.grad = None


def _master_to_compute(master: nn.Module, compute: nn.Module) -> None:
    with torch.no_grad():
        for high, low in zip(master.parameters(), compute.parameters(), strict=True):
            low.copy_(high)


def _reference_state(model: nn.Module, col: str) -> dict[str, torch.Tensor]:
    if family(col) in ("toy", "tp"):
        return dict(model.state_dict())
    return dict(model.named_parameters())


def assert_parity(
    got: dict[str, Any], want: dict[str, Any], col: str, rtol: float, what: str
) -> None:
    """Losses, eval losses and final weights within ``rtol`` relative (``assert_close_rel``:
    the largest error over the largest expected magnitude)."""
    from mfsdp_hooks.testing import assert_close_rel

    for name in ("losses", "evals"):
        assert len(got[name]) == len(want[name]), (what, name, got[name], want[name])
        for step, (a, b) in enumerate(zip(got[name], want[name], strict=True)):
            assert abs(a - b) <= rtol * abs(b), f"{what}: {name}[{step}] {a} != {b}: {got[name]}"
    weights = {k: torch.tensor(v) for k, v in got["weights"].items()}
    expected: dict[str, torch.Tensor] = want["weights"]
    if family(col) == "ep":  # each rank holds its own experts: compare those
        expected = {k: v for k, v in expected.items() if k in weights}
    assert weights.keys() == expected.keys(), (what, sorted(weights), sorted(expected))
    for name, value in expected.items():
        assert_close_rel(weights[name], value, rtol, f"{what}: {name}")
