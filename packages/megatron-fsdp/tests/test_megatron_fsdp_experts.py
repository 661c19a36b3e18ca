"""FSDP x EP through fully_shard_model(..., expt_device_mesh=...): parity and bad input."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

from megatron_fsdp import fully_shard_model, fully_shard_optimizer
from mfsdp_collectives.testing import run_distributed
from mfsdp_hooks.moe_testing import MOE_OUT, MOE_WIDTH, MoEBlock, moe_model

STEPS = 10


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
    optimizer = fully_shard_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-2))
    reference = moe_model(None)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    errors = []
    for step in range(STEPS):
        gen = torch.Generator().manual_seed(step)
        x, y = torch.randn(16, MOE_WIDTH, generator=gen), torch.randn(16, MOE_OUT, generator=gen)
        want = nn.functional.mse_loss(reference(x), y)
        want.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        loss = nn.functional.mse_loss(model(x.chunk(world)[rank]), y.chunk(world)[rank])
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        total = loss.detach().clone()
        dist.all_reduce(total)
        errors.append(abs(total.item() / world - want.item()) / abs(want.item()))
    return errors


def test_fully_shard_model_with_an_expert_mesh_trains_as_one_process() -> None:
    for errors in run_distributed(_parity_worker, 4, timeout=240):
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
