"""The seed README's API: quick start parity, documented arguments, clear errors on every rank."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import megatron_fsdp
from megatron_fsdp import fully_shard, fully_shard_model, fully_shard_optimizer
from mfsdp_collectives.testing import run_distributed


class Layer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(6, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.linear(x)) + x


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(Layer(), Layer(), nn.Linear(6, 1))


def _reference(steps: int, batch: torch.Tensor) -> list[float]:
    model = _model()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    losses = []
    for _ in range(steps):
        loss = model(batch).pow(2).mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def _quick_start(rank: int, world: int, entry: str) -> None:
    batch = torch.randn(8, 6, generator=torch.Generator().manual_seed(3))
    local = batch.chunk(world)[rank]
    layer_path = f"{Layer.__module__}.Layer"
    if entry == "model+optimizer":
        model = fully_shard_model(_model(), fsdp_unit_modules=[Layer, layer_path])
        optimizer = fully_shard_optimizer(torch.optim.Adam(model.parameters(), lr=1e-2))
    else:
        original = _model()
        model, optimizer = fully_shard(
            original, torch.optim.Adam(original.parameters(), lr=1e-2), fsdp_unit_modules=[Layer]
        )
    assert isinstance(model, megatron_fsdp.MegatronFSDP)
    losses = []
    for _ in range(5):
        loss = model(local).pow(2).mean()
        loss.backward()
        optimizer.step(sync_grad_before_optimizer_step=True, install_optimized_model_weights=True)
        optimizer.zero_grad(zero_grad_buffer=True)
        total = loss.detach().clone()
        torch.distributed.all_reduce(total)
        losses.append(total.item() / world)
    expected = _reference(5, batch)
    for got, want in zip(losses, expected, strict=True):
        assert abs(got - want) <= 1e-5 * abs(want), (losses, expected)


@pytest.mark.parametrize("entry", ["model+optimizer", "fully_shard"])
def test_quick_start_matches_single_process(entry: str) -> None:
    run_distributed(_quick_start, 2, entry, timeout=120)


def _bad_input(rank: int, world: int, case: str) -> str:
    try:
        if case == "unknown_unit":
            fully_shard_model(_model(), fsdp_unit_modules=["no.such.module.Layer"])
        elif case == "strategy":
            fully_shard_model(_model(), fsdp_unit_modules=[Layer], zero_dp_strategy=7)
        elif case == "strategy_name":
            fully_shard_model(_model(), fsdp_unit_modules=[Layer], zero_dp_strategy="zero9")
        elif case == "twice":
            model = fully_shard_model(_model(), fsdp_unit_modules=[Layer])
            fully_shard_model(model.module, fsdp_unit_modules=[Layer])
        elif case == "optimizer":
            fully_shard_optimizer(torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=0.1))
        elif case == "contiguous_step":
            model = fully_shard_model(_model(), fsdp_unit_modules=[Layer])
            fully_shard_optimizer(torch.optim.RMSprop(model.parameters()), contiguous_step=True)
        elif case == "step_chunk_numel":
            model = fully_shard_model(_model(), fsdp_unit_modules=[Layer])
            fully_shard_optimizer(torch.optim.Adam(model.parameters()), step_chunk_numel=0)
        elif case == "hsdp":
            fully_shard_model(_model(), fsdp_unit_modules=[Layer], dp_outer_dim="dp_outer")
        elif case == "meta":
            fully_shard_model(_model(), init_model_with_meta_device=True, zero_dp_strategy=0)
        elif case == "nccl_ub":
            fully_shard_model(_model(), nccl_ub=True)
    except (ValueError, TypeError, NotImplementedError) as error:
        # Every rank reaches here on its own: nothing was communicated.
        torch.distributed.barrier()
        return f"{type(error).__name__}: {error}"
    return "no error"


@pytest.mark.parametrize(
    ("case", "expected"),
    [
        ("unknown_unit", "ValueError: fsdp_unit_modules: cannot import 'no.such.module.Layer'"),
        ("strategy", "ValueError: zero_dp_strategy=7 is out of range"),
        ("strategy_name", "ValueError: zero_dp_strategy='zero9' is not a sharding strategy"),
        ("twice", "ValueError: module: it is already fully sharded"),
        ("optimizer", "ValueError: optimizer holds no fully-sharded parameters"),
        ("contiguous_step", "TypeError: contiguous_step: RMSprop is not one of the elementwise"),
        ("step_chunk_numel", "ValueError: step_chunk_numel must be a positive int"),
        ("hsdp", "ValueError: dp_outer_dim was given without hybrid_fsdp_group"),
        ("meta", "ValueError: init_model_with_meta_device=True with zero_dp_strategy=0"),
        ("nccl_ub", "NotImplementedError: nccl_ub=True: NCCL user buffers"),
    ],
)
def test_bad_input_raises_clearly_on_every_rank(case: str, expected: str) -> None:
    messages = run_distributed(_bad_input, 2, case, timeout=60)
    assert all(m.startswith(expected) for m in messages), messages


def _described(rank: int, world: int) -> list[dict[str, int]]:
    """``describe()`` through the seed one-liner, ``fully_shard_model`` and the reference's
    class, each after one AdamW step."""
    from torch.distributed.device_mesh import init_device_mesh

    totals = []
    for entry in ("seed", "fully_shard_model", "class"):
        module = _model()
        units = [Layer]
        if entry == "seed":
            model, optimizer = fully_shard(module, torch.optim.AdamW(module.parameters()), units)
        elif entry == "fully_shard_model":
            model = fully_shard_model(module, units)
            optimizer = fully_shard_optimizer(torch.optim.AdamW(model.parameters()))
        else:
            mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
            index = megatron_fsdp.FSDPDistributedIndex(mesh, dp_shard_dim="dp")
            ddp_config = megatron_fsdp.DistributedDataParallelConfig(
                data_parallel_sharding_strategy="optim_grads_params"
            )
            model = megatron_fsdp.MegatronFSDP(module, index, ddp_config, fsdp_unit_modules=units)
            optimizer = fully_shard_optimizer(torch.optim.AdamW(model.parameters()))
        model(torch.randn(2, 6)).sum().backward()
        optimizer.step()
        summary = model.describe_sharding(optimizer)
        assert "ZeRO-3" in str(summary) and summary.world_size == world
        totals.append(summary.totals())
    return totals


def test_describe_answers_through_every_root_entry_point() -> None:
    ranks = run_distributed(_described, 2, timeout=60)
    numel = sum(p.numel() for p in _model().parameters())
    for entry in range(3):
        moments = sum(totals[entry]["optimizer_state"] for totals in ranks)
        # Each element's two moments, on one rank, and AdamW's 0-d "step"s: one per
        # parameter at most, fewer where the contiguous step shares one over a run.
        counters = moments - 2 * 4 * numel
        assert 0 < counters <= len(ranks) * 4 * len(list(_model().parameters())), counters
        assert counters % 4 == 0
        assert ranks[0][entry] == ranks[0][0]  # the same sharding, whichever entry point
