"""FSDP x EP through fully_shard_model(..., expt_device_mesh=...): parity and bad input."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

from megatron_fsdp import fully_shard_model, fully_shard_optimizer
from mfsdp_collectives.testing import run_distributed
from mfsdp_hooks.testing.moe import MOE_OUT, MOE_WIDTH, MoEBlock, moe_model

STEPS = 10


def _train_against_one_process(
    model: nn.Module, reference: nn.Module, part: int, parts: int
) -> tuple[list[float], nn.Module]:
    """``STEPS`` AdamW steps of both; ``model`` on part ``part`` of ``parts`` of each global
    batch. Returns each step's relative loss error and the trained reference."""
    optimizer = fully_shard_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-2))
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    world = dist.get_world_size()
    errors = []
    for step in range(STEPS):
        gen = torch.Generator().manual_seed(step)
        x, y = torch.randn(16, MOE_WIDTH, generator=gen), torch.randn(16, MOE_OUT, generator=gen)
        want = nn.functional.mse_loss(reference(x), y)
        want.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        loss = nn.functional.mse_loss(model(x.chunk(parts)[part]), y.chunk(parts)[part])
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        total = loss.detach().clone()
        dist.all_reduce(total)  # a part held by several (TP) ranks counts once per rank
        errors.append(abs(total.item() / world - want.item()) / abs(want.item()))
    return errors, reference


def _parity_worker(rank: int, world: int) -> list[float]:
    # Dense parameters over the 4 ranks; experts (allreduce=False) over the dp_shard dim of
    # the expert mesh, i.e. the expert-data-parallel groups {0, 2} and {1, 3}.
    dense_mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp_shard",))
    expert_mesh = init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("dp_shard", "ep"))
    model = fully_shard_model(
        moe_model(expert_mesh["ep"].get_group()),
        fsdp_unit_modules=[MoEBlock],
        device_mesh=dense_mesh,
        dp_shard_dim="dp_shard",
        expt_device_mesh=expert_mesh,
    )
    return _train_against_one_process(model, moe_model(None), rank, world)[0]


def test_fully_shard_model_with_an_expert_mesh_trains_as_one_process() -> None:
    for errors in run_distributed(_parity_worker, 4, timeout=240):
        assert max(errors) <= 1e-5, errors


def _etp_worker(rank: int, world: int) -> list[float]:
    # EP=2 x expert TP=2 (EDP=1): each rank holds 2 of the 4 experts, each expert's linears
    # split Megatron-style over the TP pair {0,1} or {2,3}, which shares its tokens (the
    # dense mesh is (dp_shard=2, tp=2) with TP-replicated router and head). The EDP group
    # of size 1 must still average expert gradients over the 2 data-parallel batches.
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_shard", "tp"))
    expert_mesh = init_device_mesh("cpu", (1, 2, 2), mesh_dim_names=("dp_shard", "ep", "tp"))
    model = fully_shard_model(
        moe_model(expert_mesh["ep"].get_group(), expert_mesh["tp"]),
        fsdp_unit_modules=[MoEBlock],
        device_mesh=mesh,
        dp_shard_dim="dp_shard",
        tp_dim="tp",
        expt_device_mesh=expert_mesh,
    )
    etp = [p for p in model.parameters() if getattr(p, "tensor_model_parallel", False)]
    assert len(etp) == 2 * 2 * 3  # blocks x local experts x (fc1 weight and bias, fc2 weight)
    assert all(p.device_mesh.mesh_dim_names == ("dp_shard", "tp") for p in etp)
    dp = mesh["dp_shard"].get_local_rank()
    errors, reference = _train_against_one_process(model, moe_model(None), dp, 2)
    first = 2 * expert_mesh["ep"].get_local_rank()  # this rank's first expert
    ref_params = dict(reference.named_parameters())
    for name, param in model.named_parameters():
        parts = name.removeprefix("module.").split(".")
        if "experts" in parts:  # local expert i is global expert first + i
            at = parts.index("experts") + 1
            parts[at] = str(first + int(parts[at]))
        want_param = ref_params[".".join(parts)]
        torch.testing.assert_close(param.full_tensor(), want_param.detach(), rtol=1e-5, atol=1e-6)
    return errors


def test_expert_tensor_parallelism_trains_as_one_process() -> None:
    for errors in run_distributed(_etp_worker, 4, timeout=240):
        assert max(errors) <= 1e-5, errors


def _bad_worker(rank: int, world: int) -> str:
    expert_mesh = init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("edp", "ep"))
    try:
        fully_shard_model(
            moe_model(expert_mesh["ep"].get_group()),
            fsdp_unit_modules=[MoEBlock],
            expt_device_mesh=expert_mesh,
        )
    except ValueError as error:
        dist.barrier()
        return str(error)
    return "no error"


def test_an_expert_mesh_without_the_dp_shard_dim_is_refused_on_every_rank() -> None:
    messages = run_distributed(_bad_worker, 4, timeout=60)
    assert all("expt_device_mesh has dims ['edp', 'ep'] but no 'dp_shard'" in m for m in messages)
