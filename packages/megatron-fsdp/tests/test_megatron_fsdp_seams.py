"""What users do to a model around sharding, through every entry point (issue: seams).

* the seed one-liner ``fully_shard(model, optimizer)`` on tensor-parallel and float8 models
  (their parameters are replaced by new objects: the optimizer must follow);
* ``model.to(torch.device("cpu", 0))`` / ``.float()`` / ``.to("cpu")`` after sharding keep
  training (a copy would detach the parameters from the engine's buffers); a dtype change
  once the optimizer holds state is refused before anything moves;
* a reference to a parameter taken before sharding reads its stale values (no crash);
* an optimizer built before sharding and never handed over raises at its step; handed to
  ``fully_shard_optimizer`` it is re-pointed and trains;
* a unit class that matches nothing, and no units under ZeRO-1..3, are refused;
* a unit whose forward did not run leaves its gradients None (Adam must not move it);
* a tied weight held by two sibling units is refused.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

import megatron_fsdp
import mfsdp_hooks
from megatron_fsdp import fully_shard_model, fully_shard_optimizer
from mfsdp_collectives.testing import run_distributed
from mfsdp_hooks.testing import (
    Block,
    assert_close_rel,
    make_batches,
    make_model,
    train_data_parallel,
    train_single_process,
)
from mfsdp_hooks.testing.parity import shard_blocks
from mfsdp_hooks.testing.tp import TP_OUT, TP_WIDTH, MLPBlock, tp_model

STEPS = 10
Wrap = Callable[[nn.Module], tuple[nn.Module, torch.optim.Optimizer]]


def _adamw(params: Any) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-2)


def _seed_one_liner(model: nn.Module) -> tuple[nn.Module, torch.optim.Optimizer]:
    return megatron_fsdp.fully_shard(model, _adamw(model.parameters()), fsdp_unit_modules=[Block])


def _model_then_optimizer(model: nn.Module) -> tuple[nn.Module, torch.optim.Optimizer]:
    wrapped = fully_shard_model(model, fsdp_unit_modules=[Block])
    return wrapped, fully_shard_optimizer(_adamw(wrapped.parameters()))


def _class_api(model: nn.Module) -> tuple[nn.Module, torch.optim.Optimizer]:
    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("dp",))
    wrapped = megatron_fsdp.MegatronFSDP(
        model,
        megatron_fsdp.FSDPDistributedIndex(mesh, dp_shard_dim="dp"),
        megatron_fsdp.DistributedDataParallelConfig(
            data_parallel_sharding_strategy="optim_grads_params"
        ),
        fsdp_unit_modules=[Block],
    )
    return wrapped, fully_shard_optimizer(_adamw(wrapped.parameters()))


def _per_module(model: nn.Module) -> tuple[nn.Module, torch.optim.Optimizer]:
    shard_blocks(model)
    return model, _adamw(model.parameters())


ENTRY_POINTS: dict[str, Wrap] = {
    "seed_one_liner": _seed_one_liner,
    "model_then_optimizer": _model_then_optimizer,
    "class_api": _class_api,
    "per_module": _per_module,
}


def _reference_losses(steps: int = STEPS, seed: int = 1) -> list[float]:
    model = make_model()
    return train_single_process(model, _adamw(model.parameters()), make_batches(steps, seed=seed))


# --------------------------------------------------------------- .to(device) after sharding
def _to_device_worker(rank: int, world: int, entry: str) -> list[float]:
    model, optimizer = ENTRY_POINTS[entry](make_model())
    model.to(torch.device("cpu", 0))  # a copy: transformers.Trainer makes this call
    model.float()
    model.to("cpu")
    half = make_batches(STEPS)
    losses = train_data_parallel(model, optimizer, half[:5], rank, world, global_mean=True)
    model.to(torch.device("cpu", 0))  # again between steps, with gradients and state
    losses += train_data_parallel(model, optimizer, half[5:], rank, world, global_mean=True)
    with pytest.raises(NotImplementedError, match=r"holds state .* -> torch.float64"):
        model.double()
    with pytest.raises(NotImplementedError, match="before sharding"):
        model.to(torch.bfloat16)
    # the refused conversions changed nothing: training goes on on the same curve
    losses += train_data_parallel(
        model, optimizer, make_batches(2, seed=7), rank, world, global_mean=True
    )
    return losses


@pytest.mark.parametrize("entry", list(ENTRY_POINTS))
def test_to_device_after_sharding_keeps_training(entry: str) -> None:
    """Failed before: ``.to(torch.device("cpu", 0))`` swapped each DTensor parameter for a copy
    and the losses repeated (4.3225/4.3533) instead of falling."""
    got = run_distributed(_to_device_worker, 2, entry, timeout=180)[0]
    reference = make_model()
    ref_opt = _adamw(reference.parameters())
    want = train_single_process(reference, ref_opt, make_batches(STEPS))
    want += train_single_process(reference, ref_opt, make_batches(2, seed=7))
    assert_close_rel(torch.tensor(got), torch.tensor(want), 1e-5, f"{entry} losses")


# --------------------------------------------------------------- references kept from before
def _stale_reference_worker(rank: int, world: int, entry: str) -> None:
    model = make_model()
    kept = {name: p for name, p in model.named_parameters()}
    before = {name: p.detach().clone() for name, p in kept.items()}
    model, optimizer = ENTRY_POINTS[entry](model)
    train_data_parallel(model, optimizer, make_batches(3), rank, world)
    for name, param in kept.items():  # killed the process with SIGSEGV before
        assert torch.equal(param.detach().clone(), before[name]), name
        assert float(param.sum()) == float(before[name].sum())


@pytest.mark.parametrize("entry", list(ENTRY_POINTS))
def test_parameter_kept_from_before_sharding_reads_stale_values(entry: str) -> None:
    run_distributed(_stale_reference_worker, 2, entry, timeout=120)


# --------------------------------------------------------------- optimizers built too early
def _early_optimizer_worker(rank: int, world: int, entry: str) -> list[float] | str:
    model = make_model()
    early = _adamw(model.parameters())
    if entry == "handed_to_fully_shard_optimizer":
        wrapped = fully_shard_model(model, fsdp_unit_modules=[Block])
        optimizer = fully_shard_optimizer(early)
        return train_data_parallel(
            wrapped, optimizer, make_batches(STEPS), rank, world, global_mean=True
        )
    wrapped = fully_shard_model(model, fsdp_unit_modules=[Block]) if entry == "seed" else model
    if entry == "per_module":
        shard_blocks(model)
    tokens, targets = make_batches(1)[0]
    from mfsdp_hooks.testing import loss_fn

    loss_fn(wrapped(tokens), targets).backward()
    with pytest.raises(RuntimeError, match="replaced by fully_shard") as error:
        early.step()
    return str(error.value)


@pytest.mark.parametrize("entry", ["seed", "per_module"])
def test_optimizer_built_before_sharding_and_never_handed_over_raises(entry: str) -> None:
    """It would step stale copies the model no longer reads: nothing would train."""
    message = run_distributed(_early_optimizer_worker, 2, entry, timeout=120)[0]
    assert "blocks.0" in message or "Block(" in message, message
    assert "fully_shard_optimizer" in message


def test_optimizer_built_before_sharding_handed_over_trains() -> None:
    got = run_distributed(
        _early_optimizer_worker, 2, "handed_to_fully_shard_optimizer", timeout=120
    )
    assert_close_rel(torch.tensor(got[0]), torch.tensor(_reference_losses()), 1e-5, "losses")


# --------------------------------------------------------------- the one-liner on TP models
def _tp_one_liner_worker(rank: int, world: int) -> list[float]:
    mesh = init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("dp_shard", "tp"))
    model = tp_model("mlp", mesh["tp"])
    model, optimizer = megatron_fsdp.fully_shard(
        model,
        _adamw(model.parameters()),
        fsdp_unit_modules=[MLPBlock],
        device_mesh=mesh,
        dp_shard_dim="dp_shard",
        tp_dim="tp",
    )
    dp_rank, dp_size = mesh["dp_shard"].get_local_rank(), world // 2
    losses = []
    for step in range(STEPS):
        gen = torch.Generator().manual_seed(step)
        x, y = torch.randn(8, 4, TP_WIDTH, generator=gen), torch.randn(8, 4, TP_OUT, generator=gen)
        loss = nn.functional.mse_loss(model(x.chunk(dp_size)[dp_rank]), y.chunk(dp_size)[dp_rank])
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses.append(total.item() / world)
    return losses


def test_seed_one_liner_on_a_tensor_parallel_model() -> None:
    """Failed before: 'optimizer: parameters at positions [...] are not parameters of the
    model given to enable_dcp' (the TP parameters' replacements were not found)."""
    got = run_distributed(_tp_one_liner_worker, 4, timeout=240)[0]
    reference = tp_model("mlp", None)
    ref_opt = _adamw(reference.parameters())
    want = []
    for step in range(STEPS):
        gen = torch.Generator().manual_seed(step)
        x, y = torch.randn(8, 4, TP_WIDTH, generator=gen), torch.randn(8, 4, TP_OUT, generator=gen)
        loss = nn.functional.mse_loss(reference(x), y)
        loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        want.append(loss.item())
    assert_close_rel(torch.tensor(got), torch.tensor(want), 1e-5, "TP one-liner losses")


def _float8_one_liner_worker(rank: int, world: int) -> list[float]:
    from mfsdp_te.float8_testing import Float8Block, float8_model, float8_step

    model = float8_model()
    model, optimizer = megatron_fsdp.fully_shard(
        model, _adamw(model.parameters()), fsdp_unit_modules=[Float8Block]
    )
    return [float8_step(model, optimizer, step, world, sharded=True) for step in range(STEPS)]


def test_seed_one_liner_on_a_float8_model() -> None:
    pytest.importorskip("torchao.float8", reason="torchao is not installed (nox installs it)")
    from mfsdp_te.float8_testing import float8_model, float8_step

    got = run_distributed(_float8_one_liner_worker, 2, timeout=240)[0]
    reference = float8_model()
    ref_opt = _adamw(reference.parameters())
    want = [float8_step(reference, ref_opt, step, 2, sharded=False) for step in range(STEPS)]
    assert_close_rel(torch.tensor(got), torch.tensor(want), 1e-5, "float8 one-liner losses")


# --------------------------------------------------------------- units that match nothing
def _unit_refusal_worker(rank: int, world: int, case: str) -> None:
    if case == "unmatched":
        with pytest.raises(ValueError, match=r"TransformerEncoderLayer\] matches no module"):
            fully_shard_model(make_model(), fsdp_unit_modules=[nn.TransformerEncoderLayer])
    elif case == "none_under_zero3":
        with pytest.raises(ValueError, match="fsdp_unit_modules is required"):
            fully_shard_model(make_model())
        with pytest.raises(ValueError, match="fsdp_unit_modules is required"):
            megatron_fsdp.fully_shard(make_model(), _adamw(make_model().parameters()))
    else:  # DDP-like replication needs no units; one whole-model unit is asked for by name
        fully_shard_model(make_model(), zero_dp_strategy=0)
        whole = fully_shard_model(make_model(), fsdp_unit_modules=[type(make_model())])
        assert len(mfsdp_hooks.fsdp_units(whole)) == 1


@pytest.mark.parametrize("case", ["unmatched", "none_under_zero3", "allowed"])
def test_unit_modules_that_match_nothing_are_refused(case: str) -> None:
    run_distributed(_unit_refusal_worker, 2, case, timeout=120)


# --------------------------------------------------------------- units that took no part
def _non_root_backward_worker(rank: int, world: int, entry: str) -> list[float]:
    model, optimizer = ENTRY_POINTS[entry](make_model())
    inner = model.module if isinstance(model, megatron_fsdp.MegatronFSDP) else model
    head_before = inner.value.weight.full_tensor().clone()
    losses = []
    for step in range(4):
        x = torch.randn(6, 5, 15, generator=torch.Generator().manual_seed(step))
        loss = inner.blocks[1](x.chunk(world)[rank]).pow(2).mean()  # one non-root unit alone
        loss.backward()
        assert inner.value.weight.grad is None  # the root took no part
        assert inner.blocks[1].fc1.weight.grad is not None
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    assert torch.equal(inner.value.weight.full_tensor(), head_before)
    return losses


@pytest.mark.parametrize("entry", list(ENTRY_POINTS))
def test_units_that_took_no_part_keep_no_gradient(entry: str) -> None:
    """Failed before: the root's parameters got reduced zeros and AdamW (weight decay) moved
    them although no forward used them (FSDP2's test_non_root_forward_backward)."""
    run_distributed(_non_root_backward_worker, 2, entry, timeout=120)


# --------------------------------------------------------------- tied weights across units
class _Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)
        self.b.weight = self.a.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.b(self.a(x))
        return out


def _tied_siblings_worker(rank: int, world: int) -> None:
    model = _Tied()
    mfsdp_hooks.fully_shard(model.a)
    with pytest.raises(
        ValueError, match=r"'weight' of Linear is shared with the FSDP unit Linear"
    ) as e:
        mfsdp_hooks.fully_shard(model.b)
    assert "already managed by another" in str(e.value)  # the words FSDP2's ValueError has


def test_tied_weight_in_two_sibling_units_is_refused() -> None:
    """Crashed before with 'setStorage ... out of bounds' at the first forward."""
    run_distributed(_tied_siblings_worker, 2, timeout=60)
