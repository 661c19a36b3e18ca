"""FSDP x EP: a mixture-of-experts model whose experts are split over expert-parallel ranks.

Four gloo ranks: dense parameters (the routers, the head) sharded and reduced over all four,
expert parameters (``allreduce=False``) over their expert-data-parallel group of two, with
EP=2 moving tokens by all-to-all. The model trains exactly as one process holding every
expert on the global batch, at ZeRO-1/2/3 and with gradient accumulation.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from hooks_models import assert_close_rel
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

from mfsdp_collectives import CommTracer, FSDPTopology
from mfsdp_collectives.testing import run_distributed
from mfsdp_hooks import ExpertSharding, fsdp_units, fully_shard
from mfsdp_hooks.testing.moe import MOE_OUT, MOE_WIDTH, MoEBlock, moe_model

STEPS = 10


def _wrapped(world: int, strategy: int, ep: int = 2) -> tuple[nn.Module, object]:
    """The EP model, each block one FSDP unit: dense over every rank, experts over EDP."""
    ep_mesh = init_device_mesh("cpu", (world // ep, ep), mesh_dim_names=("edp", "ep"))
    dp_mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp_shard",))
    experts = ExpertSharding(
        topology=FSDPTopology.from_mesh(ep_mesh, dp_shard_dim="edp"), mean_over=world
    )
    model = moe_model(ep_mesh["ep"].get_group())
    for block in model.blocks:
        fully_shard(block, mesh=dp_mesh, sharding_strategy=strategy, experts=experts)
    fully_shard(model, mesh=dp_mesh, sharding_strategy=strategy)
    return model, ep_mesh


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(step)
    return torch.randn(16, MOE_WIDTH, generator=gen), torch.randn(16, MOE_OUT, generator=gen)


def _parity_worker(
    rank: int, world: int, strategy: int, accumulate: bool, ep: int = 2
) -> list[float]:
    model, _ = _wrapped(world, strategy, ep)
    reference = moe_model(None)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    errors = []
    for step in range(STEPS):
        x, y = _batch(step)
        want = nn.functional.mse_loss(reference(x), y)
        want.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        micro = 2 if accumulate else 1
        total = torch.zeros(())
        parts = zip(
            x.chunk(world)[rank].chunk(micro), y.chunk(world)[rank].chunk(micro), strict=True
        )
        for index, (mx, my) in enumerate(parts):
            loss = nn.functional.mse_loss(model(mx), my) / micro
            if index < micro - 1:
                with model.no_sync():  # type: ignore[operator]
                    loss.backward()
            else:
                loss.backward()
            total += loss.detach()
        optimizer.step()
        optimizer.zero_grad()
        dist.all_reduce(total)
        errors.append(abs(total.item() / world - want.item()) / abs(want.item()))
    _check_weights(model, reference)
    return errors


def _check_weights(model: nn.Module, reference: nn.Module) -> None:
    """Every parameter equals the reference's; an expert is compared with its own index."""
    units = fsdp_units(model)
    for unit in units:
        unit.unshard()
    want = reference.state_dict()
    for name, value in model.state_dict().items():
        parts = name.split(".")
        if "experts" in parts:  # blocks.B.experts.K.* holds global expert first_expert + K
            block = model.blocks[int(parts[1])]  # type: ignore[index]
            assert isinstance(block, MoEBlock)
            parts[3] = str(block.first_expert + int(parts[3]))
        assert_close_rel(value, want[".".join(parts)], 1e-5, name)
    for unit in units:
        unit.reshard()


@pytest.mark.parametrize(
    ("strategy", "accumulate"), [(3, False), (2, False), (1, False), (3, True)]
)
def test_fsdp_x_ep_trains_as_one_process(strategy: int, accumulate: bool) -> None:
    for errors in run_distributed(_parity_worker, 4, strategy, accumulate, timeout=240):
        assert max(errors) <= 1e-5, errors


def test_an_expert_data_parallel_group_of_one_reduces_each_gradient_once() -> None:
    # EP=4: every rank holds one expert alone (EDP of size 1). With accumulation no
    # micro-batch's expert gradient may be counted twice (NVIDIA/Megatron-LM#6660).
    for errors in run_distributed(_parity_worker, 4, 3, True, 4, timeout=240):
        assert max(errors) <= 1e-5, errors


def _groups_worker(rank: int, world: int) -> tuple[dict[str, dict[str, int]], list[int], list[int]]:
    model, _ = _wrapped(world, 3)
    x, y = _batch(0)
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
