"""Muon that is exact on sharded parameters: each whole update matrix orthogonalised once.

``torch.optim.Muon``'s Newton-Schulz iteration reads the whole matrix: on a rank's rows of it
(FSDP2, or any ZeRO) it computes something else without a word. :class:`Muon` takes torch's
arguments and state (``momentum_buffer`` laid out as its parameter, so checkpoints reshard it
like any other state) and splits the step where the math allows: the momentum, the Nesterov
blend, the weight decay and adding the update run on each rank's rows; the orthogonalisation
runs once per matrix on one rank of its shard group
(:func:`~mfsdp_hooks.optim.whole_matrix.map_whole_matrices`). Each value equals what
``torch.optim.Muon`` computes on one process; under HSDP each replica's shard group repeats
the same work on the same (all-reduced) values. A param group with ``use_muon=False`` (the
embeddings, norms, biases and head, as Muon users configure it) steps as
``torch.optim.AdamW``, with AdamW's defaults and state (``lr`` Muon's), so one optimizer
serves the seed API's ``fully_shard(model, optimizer)``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch.optim.adamw import adamw

from mfsdp_hooks.dtensor.dtensor_views import local_tensor
from mfsdp_hooks.optim.whole_matrix import MatrixRows, map_whole_matrices, rows_of
from mfsdp_hooks.runtime.elementwise_optimizers import declare_shard_aware_optimizer
from mfsdp_hooks.weights.lookup import locate

__all__ = ["Muon", "newton_schulz", "newton_schulz_cost"]

_NS_DTYPE = torch.bfloat16  # the iteration's dtype, as torch's Muon computes it
_ADAMW_DEFAULTS = {"betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 1e-2}  # AdamW's


def newton_schulz(
    matrix: torch.Tensor, coefficients: tuple[float, float, float], steps: int, eps: float
) -> torch.Tensor:
    """The quintic Newton-Schulz iteration Muon orthogonalises with (Keller Jordan's, as
    ``torch.optim.Muon`` runs it: bfloat16, the wide side kept as columns, normalised by the
    Frobenius norm), returned in bfloat16."""
    a, b, c = coefficients
    # A copy even in bfloat16: torch's normalises a bfloat16 update in place, which is the
    # momentum buffer itself without Nesterov; here the buffer never changes, sharded or not.
    x = matrix.to(_NS_DTYPE, copy=True)
    tall = matrix.size(0) > matrix.size(1)
    if tall:
        x = x.T
    x.div_(x.norm().clamp(min=eps))
    for _ in range(steps):
        gram = x @ x.T
        polynomial = torch.addmm(gram, gram, gram, beta=b, alpha=c)
        x = torch.addmm(x, polynomial, x, beta=a)
    return x.T if tall else x


def newton_schulz_cost(shape: torch.Size) -> int:
    """The iteration's multiply-adds up to a constant: ``m * n * min(m, n)``."""
    rows, cols = shape[0], shape[1]
    return rows * cols * min(rows, cols)


def _adjusted_lr(lr: float, adjust_lr_fn: str | None, shape: torch.Size) -> float:
    """torch's rule: Keller's ``sqrt(max(1, A / B))`` ("original", the default) or
    Moonshot's ``0.2 * sqrt(max(A, B))`` ("match_rms_adamw")."""
    rows, cols = shape[0], shape[1]
    if adjust_lr_fn in (None, "original"):
        return lr * math.sqrt(max(1.0, rows / cols))
    return lr * (0.2 * math.sqrt(max(rows, cols)))


def _name(param: torch.Tensor) -> str:
    """The parameter's name in its model where the engine knows it, else its shape."""
    location = locate(param)
    if location is not None:
        return location.group.full_names[location.index]
    return f"a parameter of shape {tuple(param.shape)}"


def _scalar(value: Any) -> float:
    return float(value.item()) if isinstance(value, torch.Tensor) else float(value)


def _check_args(lr: Any, momentum: float, weight_decay: float, adjust_lr_fn: str | None) -> None:
    if isinstance(lr, torch.Tensor) and lr.numel() != 1:
        raise ValueError("lr: a tensor learning rate must have one element")
    if not _scalar(lr) >= 0.0:
        raise ValueError(f"lr must be >= 0, got {lr}")
    if not momentum >= 0.0:
        raise ValueError(f"momentum must be >= 0, got {momentum}")
    if not weight_decay >= 0.0:
        raise ValueError(f"weight_decay must be >= 0, got {weight_decay}")
    if adjust_lr_fn not in (None, "original", "match_rms_adamw"):
        raise ValueError(
            f"adjust_lr_fn must be None, 'original' or 'match_rms_adamw', got {adjust_lr_fn!r}"
        )


@declare_shard_aware_optimizer
class Muon(torch.optim.Muon):
    """``torch.optim.Muon``, exact on parameters sharded by any entry point (module doc).

    Same arguments and defaults as torch's; a param group may say ``use_muon=False`` to step
    as AdamW. Reads ``.grad``; a matrix split over tensor parallelism is refused by name when
    the optimizer is built on it, or at the first step (before any state changes) when it is
    sharded after.
    """

    use_decoupled_grad = False  # it reads .grad (the engine refuses decoupled gradients)

    def __init__(
        self,
        params: Iterable[Any],
        lr: float | torch.Tensor = 1e-3,
        weight_decay: float = 0.1,
        momentum: float = 0.95,
        nesterov: bool = True,
        ns_coefficients: tuple[float, float, float] = (3.4445, -4.775, 2.0315),
        eps: float = 1e-7,
        ns_steps: int = 5,
        adjust_lr_fn: str | None = None,
    ) -> None:
        _check_args(lr, momentum, weight_decay, adjust_lr_fn)
        if not 0 < ns_steps < 100:
            raise ValueError(f"ns_steps must be in [1, 100), got {ns_steps}")
        defaults = {
            "lr": lr,
            "weight_decay": weight_decay,
            "momentum": momentum,
            "nesterov": nesterov,
            "ns_coefficients": tuple(ns_coefficients),
            "eps": eps,
            "ns_steps": ns_steps,
            "adjust_lr_fn": adjust_lr_fn,
            "use_muon": True,
        }
        # torch's Muon.__init__ refuses any group holding a non-2-D parameter; ours checks
        # the Muon groups only (add_param_group), so AdamW groups may hold the rest.
        torch.optim.Optimizer.__init__(self, params, defaults)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        if param_group.get("use_muon", True) is False:
            for key, value in _ADAMW_DEFAULTS.items():
                param_group.setdefault(key, value)
        else:
            params = param_group["params"]
            params = [params] if isinstance(params, torch.Tensor) else list(params)
            param_group["params"] = params  # a generator is read once, here
            flat = [p for p in params if p.ndim != 2]
            if flat:
                raise ValueError(
                    f"params: Muon steps 2-D matrices only, got one of shape "
                    f"{tuple(flat[0].shape)}; put the others in a group with use_muon=False "
                    "(stepped as AdamW) or in another optimizer"
                )
            for param in params:  # already sharded (per-module API): refused at once
                rows_of(param, _name(param))
        super(torch.optim.Muon, self).add_param_group(param_group)

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        matrices: list[tuple[torch.Tensor, dict[str, Any], MatrixRows]] = []
        for group in self.param_groups:
            if group.get("use_muon", True) is False:
                self._adamw_step(group)
            else:
                matrices += self._momentum_step(group)
        if matrices:
            self._apply_orthogonalised(matrices)
        return loss

    def _momentum_step(
        self, group: dict[str, Any]
    ) -> list[tuple[torch.Tensor, dict[str, Any], MatrixRows]]:
        """Element-wise, on this rank's rows: the momentum and the update to orthogonalise.
        Every layout is read first: a refused one (tensor parallel) changes no state."""
        momentum, nesterov = group["momentum"], group["nesterov"]
        params = [p for p in group["params"] if p.grad is not None]
        layouts = [rows_of(param, _name(param)) for param in params]
        updates = []
        for param, layout in zip(params, layouts, strict=True):
            state = self.state[param]
            if "momentum_buffer" not in state:
                state["momentum_buffer"] = torch.zeros_like(
                    param.grad, memory_format=torch.preserve_format
                )
            grad = local_tensor(param.grad)
            buf = local_tensor(state["momentum_buffer"])
            buf.lerp_(grad, 1 - momentum)
            update = grad.lerp(buf, momentum) if nesterov else buf
            updates.append((param, group, layout.with_local(update)))
        return updates

    def _apply_orthogonalised(
        self, matrices: list[tuple[torch.Tensor, dict[str, Any], MatrixRows]]
    ) -> None:
        def orthogonalise(index: int, whole: torch.Tensor) -> torch.Tensor:
            group = matrices[index][1]
            return newton_schulz(whole, group["ns_coefficients"], group["ns_steps"], group["eps"])

        rows = map_whole_matrices(
            [layout for _, _, layout in matrices], orthogonalise, newton_schulz_cost, _NS_DTYPE
        )
        for (param, group, _), update in zip(matrices, rows, strict=True):
            lr = _scalar(group["lr"])
            weights = local_tensor(param)
            weights.mul_(1 - lr * group["weight_decay"])
            weights.add_(update, alpha=-_adjusted_lr(lr, group["adjust_lr_fn"], param.shape))

    def _adamw_step(self, group: dict[str, Any]) -> None:
        """A ``use_muon=False`` group: torch's AdamW on each rank's rows (element-wise)."""
        params, grads, exp_avgs, exp_avg_sqs, steps = [], [], [], [], []
        for param in group["params"]:
            if param.grad is None:
                continue
            state = self.state[param]
            if not state:
                state["step"] = torch.tensor(0.0)
                state["exp_avg"] = torch.zeros_like(param, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(param, memory_format=torch.preserve_format)
            params.append(local_tensor(param))
            grads.append(local_tensor(param.grad))
            exp_avgs.append(local_tensor(state["exp_avg"]))
            exp_avg_sqs.append(local_tensor(state["exp_avg_sq"]))
            steps.append(state["step"])
        if not params:
            return
        beta1, beta2 = group["betas"]
        adamw(
            params,
            grads,
            exp_avgs,
            exp_avg_sqs,
            [],
            steps,
            amsgrad=False,
            beta1=beta1,
            beta2=beta2,
            lr=group["lr"],
            weight_decay=group["weight_decay"],
            eps=group["eps"],
            maximize=False,
        )
