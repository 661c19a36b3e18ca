"""FSDP x EP through fully_shard_model(..., expt_device_mesh=...): parity and bad input."""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

from megatron_fsdp import fully_shard_model, fully_shard_optimizer
from mfsdp_collectives.testing import run_distributed
from mfsdp_hooks.testing.moe import MoEBlock, expert_weights, moe_batches, moe_model
from mfsdp_hooks.testing.parity import ParityCase, run_parity


def _expert_mesh(_: object) -> nn.Module:
    """Dense parameters over the 4 ranks; experts (allreduce=False) over the dp_shard dim of
    the expert mesh, i.e. the expert-data-parallel groups {0, 2} and {1, 3}."""
    world = dist.get_world_size()
    dense_mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp_shard",))
    expert_mesh = init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("dp_shard", "ep"))
    return fully_shard_model(
        moe_model(expert_mesh["ep"].get_group()),
        fsdp_unit_modules=[MoEBlock],
        device_mesh=dense_mesh,
        dp_shard_dim="dp_shard",
        expt_device_mesh=expert_mesh,
    )


def _expert_tp(_: object) -> nn.Module:
    """EP=2 x expert TP=2 (EDP=1): each rank holds 2 of the 4 experts, each expert's linears
    split Megatron-style over the TP pair {0,1} or {2,3}, which shares its tokens (the dense
    mesh is (dp_shard=2, tp=2) with TP-replicated router and head). The EDP group of size 1
    must still average expert gradients over the 2 data-parallel batches."""
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
    return model


def _expert_case(label: str, shard: Callable[[nn.Module], nn.Module], share: int) -> ParityCase:
    return ParityCase(
        label,
        shard,
        model=partial(moe_model, None),
        sharded_optimizer=fully_shard_optimizer,
        batches=moe_batches,
        loss=nn.functional.mse_loss,
        share=share,  # ranks of one TP group take the same share
        weights=expert_weights,
    )


def test_fully_shard_model_with_an_expert_mesh_and_expert_tp_trains_as_one_process() -> None:
    run_parity(
        4, [_expert_case("EP=2", _expert_mesh, 1), _expert_case("EP=2 x ETP=2", _expert_tp, 2)]
    )


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
