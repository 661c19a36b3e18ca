"""FSDP x EP: a mixture-of-experts model whose experts are split over expert-parallel ranks.

Four gloo ranks: dense parameters (the routers, the head) sharded and reduced over all four,
expert parameters (``allreduce=False``) over their expert-data-parallel group of two, with
EP=2 moving tokens by all-to-all. The model trains exactly as one process holding every
expert on the global batch, at ZeRO-1/2/3 and with gradient accumulation.
"""

from __future__ import annotations

from functools import partial

import torch.distributed as dist
from hooks_models import full_state
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

from mfsdp_collectives import CommTracer, FSDPTopology
from mfsdp_collectives.testing import run_distributed
from mfsdp_hooks import ExpertSharding, fsdp_units, fully_shard
from mfsdp_hooks.testing.moe import expert_weights, moe_batches, moe_model
from mfsdp_hooks.testing.parity import ParityCase, run_parity


def _expert_parallel(_: object, strategy: int, ep: int = 2) -> nn.Module:
    """The EP model, each block one FSDP unit: dense over every rank, experts over EDP
    (built here: each EP rank keeps only its experts)."""
    world = dist.get_world_size()
    ep_mesh = init_device_mesh("cpu", (world // ep, ep), mesh_dim_names=("edp", "ep"))
    dp_mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp_shard",))
    experts = ExpertSharding(
        topology=FSDPTopology.from_mesh(ep_mesh, dp_shard_dim="edp"), mean_over=world
    )
    model = moe_model(ep_mesh["ep"].get_group())
    for block in model.blocks:
        fully_shard(block, mesh=dp_mesh, sharding_strategy=strategy, experts=experts)
    return fully_shard(model, mesh=dp_mesh, sharding_strategy=strategy)


def _ep_case(strategy: int, accumulate: bool, ep: int = 2) -> ParityCase:
    """The MoE model with its experts split over ``ep`` ranks; ``accumulate``: two
    micro-batches a step, the first under ``no_sync``."""
    return ParityCase(
        f"EP={ep} strategy={strategy} accumulate={accumulate}",
        partial(_expert_parallel, strategy=strategy, ep=ep),
        model=partial(moe_model, None),
        batches=moe_batches,
        loss=nn.functional.mse_loss,
        micro=2 if accumulate else 1,
        weights=partial(expert_weights, read=full_state),
    )


def test_fsdp_x_ep_trains_as_one_process() -> None:
    cases = [_ep_case(3, False), _ep_case(2, False), _ep_case(1, False), _ep_case(3, True)]
    run_parity(4, cases)


def test_an_expert_data_parallel_group_of_one_reduces_each_gradient_once() -> None:
    # EP=4: every rank holds one expert alone (EDP of size 1). With accumulation no
    # micro-batch's expert gradient may be counted twice (NVIDIA/Megatron-LM#6660).
    run_parity(4, [_ep_case(3, True, ep=4)])


def _groups_worker(rank: int, world: int) -> tuple[dict[str, dict[str, int]], list[int], list[int]]:
    model = _expert_parallel(None, 3)
    x, y = moe_batches(1)[0]
    for _ in range(2):  # the first records the prefetch order
        with CommTracer() as tracer:
            nn.functional.mse_loss(model(x.chunk(world)[rank]), y.chunk(world)[rank]).backward()
    groups = [g for u in fsdp_units(model) for g in u.groups if g.requires_grad]
    dense = [g.layout.padded_numel for g in groups if g.topology.shard_size == world]
    expert = [g.layout.padded_numel for g in groups if g.topology.shard_size == world // 2]
    return tracer.summary(), dense, expert


def test_expert_parameters_are_reduced_over_the_expert_data_parallel_group_only() -> None:
    for summary, dense, expert in run_distributed(_groups_worker, 4, timeout=120):
        # 2 blocks (router; experts) + the root's head: 3 dense groups, 2 expert groups.
        assert (len(dense), len(expert)) == (3, 2)
        assert summary["dp_shard/reduce_scatter"] == {"calls": 3, "bytes": 4 * sum(dense)}
        assert summary["expert_dp/reduce_scatter"] == {"calls": 2, "bytes": 4 * sum(expert)}
