"""Parity: sharded training on real ranks equals one process training on the whole batch.

Every sharding feature is held to the same check. The same seeded model and optimizer train
in one process on each global batch and, sharded, on each rank's share of it (micro-batches
under ``no_sync``, or all of them left to ``finish_grad_sync``); the global loss of every step
and the full weights before and after training must agree within ``rtol``. A
:class:`ParityCase` says only what differs: how the model is sharded, and where the toy
defaults do not fit, the model, data, loss and optimizer (handed to the entry point, or
swapped for a fresh pair by a checkpoint round trip mid-run). :func:`run_parity` runs a list of
cases in one world, since starting a world costs more than a case; :func:`check_parity` is
one case inside a worker that checks more afterwards. A feature's parity test::

    def test_zero2_trains_as_one_process() -> None:
        run_parity(2, [ParityCase("zero2", partial(shard_blocks, sharding_strategy=2))])

Cases travel to the ranks by pickle: give module-level functions, or ``functools.partial``
of them, never lambdas.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from mfsdp_collectives.testing import run_distributed
from mfsdp_hooks.api.fully_shard import fsdp_units, fully_shard
from mfsdp_hooks.testing import assert_close_rel, loss_fn, make_batches, make_model
from mfsdp_hooks.testing.tp import full_value

__all__ = [
    "Pair",
    "ParityCase",
    "adamw",
    "check_parity",
    "full_state",
    "full_weights",
    "inner",
    "parity_worker",
    "run_parity",
    "shard_blocks",
    "trainable",
]

Batch = tuple[torch.Tensor, torch.Tensor]
Pair = tuple[nn.Module, torch.optim.Optimizer]
Weights = Callable[[nn.Module], dict[str, torch.Tensor]]


def adamw(params: Any) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-2)


def trainable(model: nn.Module) -> list[nn.Parameter]:
    """The parameters an optimizer steps (the toy model has a frozen layer)."""
    return [p for p in model.parameters() if p.requires_grad]


def inner(model: nn.Module) -> nn.Module:
    """The user's model inside its wrappers (``FSDPRootWrapper``, ``MegatronFSDP``, the
    Megatron-Core adapter each hold it as ``.module``): its names are the unwrapped ones."""
    while isinstance(getattr(model, "module", None), nn.Module):
        model = model.module  # type: ignore[assignment]
    return model


def full_weights(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter's full value through ``DTensor.full_tensor`` (collective), by its
    unwrapped name; a plain model's own parameters."""
    return {n: full_value(p.detach()).clone() for n, p in inner(model).named_parameters()}


def full_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The unwrapped state dict with every unit unsharded (the engine's own gather; DTensors
    left by tensor parallelism made whole), in fp32."""
    units = fsdp_units(model)
    for unit in units:
        unit.unshard()
    state = {
        k: full_value(v.detach()).clone().float() for k, v in inner(model).state_dict().items()
    }
    for unit in units:
        unit.reshard()
    return state


def shard_blocks(model: nn.Module, impl: str = "ours", **options: Any) -> nn.Module:
    """FSDP2's pattern: ``fully_shard`` each of ``model.blocks``, then the root, with the same
    options; ours (``impl="ours"``) or torch's FSDP2 (``"fsdp2"``). Returns ``model``."""
    shard: Any = fully_shard
    if impl == "fsdp2":
        from torch.distributed.fsdp import fully_shard as torch_fully_shard

        shard = torch_fully_shard
    for block in model.blocks:  # type: ignore[union-attr]
        shard(block, **options)
    shard(model, **options)
    return model


@dataclass(frozen=True)
class ParityCase:
    """One sharded training run and what it must equal. Defaults: the toy model
    (``mfsdp_hooks.testing``), its batches and loss, AdamW, 10 steps."""

    label: str
    shard: Callable[[nn.Module], nn.Module] | None = None
    """The entry point under test: a fresh ``model()`` -> the sharded model. It may build
    its own (on the meta device, tensor-parallel) if it starts from the same weights, and
    assert what wrapping must give. Give it or ``wrap``."""
    model: Callable[[], nn.Module] = make_model
    """The seeded model: the one-process reference, and (fresh) what ``shard``/``wrap`` takes."""
    optimizer: Callable[[list[nn.Parameter]], torch.optim.Optimizer] = adamw
    """Built alike on both models' trainable parameters."""
    sharded_optimizer: Callable[[torch.optim.Optimizer], torch.optim.Optimizer] | None = None
    """What the entry point does to the sharded model's optimizer (``attach_optimizer``)."""
    batches: Callable[[int], list[Batch]] = make_batches
    """``steps`` -> one global batch per step (its rows divide over the ranks' shares)."""
    loss: Callable[[Any, torch.Tensor], torch.Tensor] = loss_fn
    steps: int = 10
    micro: int = 1
    """Micro-batches each rank cuts its share of a step's batch into."""
    finish: bool = False
    """Every micro-batch under ``no_sync``, then ``finish_grad_sync`` (else the last syncs)."""
    share: int = 1
    """Consecutive ranks that take the same share of a batch (the tensor-parallel size)."""
    forward: Callable[[nn.Module, torch.Tensor], Any] | None = None
    """How the sharded model takes its share (a sequence shard in, a DTensor out)."""
    reference_shares: bool = False
    """The reference runs each share as a micro-batch of its own (float8 scales activations
    per tensor: on the whole batch it would quantise differently)."""
    weights: Weights = full_weights
    """How both models' full weights are read (:func:`full_state`: the engine's unshard)."""
    before_step: Callable[[nn.Module, int], None] | None = None
    rtol: float = 1e-5
    wrap: Callable[[nn.Module, torch.optim.Optimizer], Pair] | None = None
    """Instead of ``shard``, an entry point handed the optimizer (the seed's ``fully_shard(model,
    optimizer)``): a fresh ``model()`` and ``optimizer`` built on its original parameters ->
    the sharded model and the optimizer to step (``sharded_optimizer`` is not applied)."""
    resume: Callable[[nn.Module, torch.optim.Optimizer, int], Pair] | None = None
    """A round trip mid-run: after ``resume_at`` steps, the sharded pair and that step -> a
    fresh pair holding the saved state, which trains on (the reference never stops)."""
    resume_at: int = 5


def check_parity(rank: int, world: int, case: ParityCase) -> nn.Module:
    """Train ``case`` sharded on this rank and in one process; assert the weights after
    sharding (exactly), every step's global loss and the trained weights (``rtol``) agree.
    Returns the trained sharded model."""
    reference = case.model()
    if case.wrap is None:
        assert case.shard is not None, f"{case.label}: give ParityCase shard or wrap"
        model = case.shard(case.model())
        optimizer = case.optimizer(trainable(model))
        if case.sharded_optimizer is not None:
            optimizer = case.sharded_optimizer(optimizer)
    else:
        fresh = case.model()
        model, optimizer = case.wrap(fresh, case.optimizer(trainable(fresh)))
    _assert_weights(case, model, reference, 0.0, "after sharding")
    ref_opt = case.optimizer(trainable(reference))
    part, parts = rank // case.share, world // case.share
    for step, batch in enumerate(case.batches(case.steps)):
        if case.resume is not None and step == case.resume_at:
            model, optimizer = case.resume(model, optimizer, step)
        if case.before_step is not None:
            case.before_step(model, step)
        want = _reference_step(case, reference, ref_opt, batch, parts)
        got = _sharded_step(case, model, optimizer, batch, part, parts)
        assert abs(got - want) <= case.rtol * abs(want), (
            f"{case.label} step {step}: {got} vs {want}"
        )
    _assert_weights(case, model, reference, case.rtol, f"after {case.steps} steps")
    return model


def parity_worker(rank: int, world: int, cases: Sequence[ParityCase]) -> None:
    """``run_distributed``'s worker: every case in turn, in this world."""
    for case in cases:
        check_parity(rank, world, case)


def run_parity(world: int, cases: Sequence[ParityCase], timeout: float = 240.0) -> None:
    """Every case on ``world`` gloo ranks, in one world."""
    run_distributed(parity_worker, world, list(cases), timeout=timeout)


def _reference_step(
    case: ParityCase,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    batch: Batch,
    parts: int,
) -> float:
    """The whole batch in one pass (or each share as a micro-batch of its own)."""
    shares = parts if case.reference_shares else 1
    total = 0.0
    for x, y in zip(*(t.chunk(shares) for t in batch), strict=True):
        loss = case.loss(model(x), y) / shares
        loss.backward()  # type: ignore[no-untyped-call]
        total += loss.item()
    optimizer.step()
    optimizer.zero_grad()
    return total


def _sharded_step(
    case: ParityCase,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    batch: Batch,
    part: int,
    parts: int,
) -> float:
    """This rank's share of the batch in ``micro`` micro-batches; the step's loss averaged
    over the world."""
    shares = [t.chunk(parts)[part].chunk(case.micro) for t in batch]
    losses = []
    for index, (x, y) in enumerate(zip(*shares, strict=True)):
        out = model(x) if case.forward is None else case.forward(model, x)
        loss = case.loss(out, y) / case.micro
        synced = not case.finish and index == case.micro - 1
        with contextlib.nullcontext() if synced else model.no_sync():  # type: ignore[operator]
            loss.backward()  # type: ignore[no-untyped-call]
        losses.append(loss.detach().float())
    if case.finish:
        model.finish_grad_sync()  # type: ignore[operator]
    optimizer.step()
    optimizer.zero_grad()
    total = torch.stack(losses).sum()  # on the model's device (NCCL reduces there)
    dist.all_reduce(total)  # ranks sharing a part (TP) each count it: divide by the world
    return total.item() / dist.get_world_size()


def _assert_weights(
    case: ParityCase, model: nn.Module, reference: nn.Module, rtol: float, when: str
) -> None:
    got, want = case.weights(model), case.weights(reference)
    assert got.keys() == want.keys(), f"{case.label} {when}: {sorted(got.keys() ^ want.keys())}"
    for name, value in want.items():
        assert_close_rel(got[name], value, rtol, f"{case.label} {when}: {name}")
