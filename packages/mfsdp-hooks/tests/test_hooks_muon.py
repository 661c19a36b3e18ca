"""Our Muon and the whole-matrix exchange under it.

On whole tensors ``Muon`` is ``torch.optim.Muon`` plus ``torch.optim.AdamW`` bit for bit;
on rows, ``map_whole_matrices`` gives every rank its rows of ``compute(whole matrix)``,
computing each matrix once, on owners balanced by cost, with the ideal bytes on the wire.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from mfsdp_collectives import CommTracer
from mfsdp_collectives.testing import run_distributed
from mfsdp_hooks import Muon, map_whole_matrices, row_sharded
from mfsdp_hooks.optim.muon import newton_schulz_cost
from mfsdp_hooks.optim.whole_matrix import plan_owners, rows_of


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 9), nn.Tanh(), nn.Linear(9, 4), nn.LayerNorm(4))


def _split(model: nn.Module) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
    matrices = [p for p in model.parameters() if p.ndim == 2]
    return matrices, [p for p in model.parameters() if p.ndim != 2]


def _train(model: nn.Module, optimizers: list[Any], steps: int = 10) -> None:
    generator = torch.Generator().manual_seed(1)
    for _ in range(steps):
        x = torch.randn(5, 6, generator=generator)
        model(x).pow(2).mean().backward()
        for optimizer in optimizers:
            optimizer.step()
            optimizer.zero_grad()


@pytest.mark.parametrize(
    "nesterov, adjust_lr_fn, weight_decay",
    [(True, None, 0.1), (False, "match_rms_adamw", 0.0), (True, "original", 0.05)],
)
def test_on_whole_tensors_it_is_torchs_muon_and_adamw_bit_for_bit(
    nesterov: bool, adjust_lr_fn: str | None, weight_decay: float
) -> None:
    muon_args = dict(
        lr=0.02, weight_decay=weight_decay, nesterov=nesterov, adjust_lr_fn=adjust_lr_fn
    )
    reference = _model()
    matrices, rest = _split(reference)
    _train(
        reference,
        [torch.optim.Muon(matrices, **muon_args), torch.optim.AdamW(rest, lr=1e-2, eps=1e-8)],
    )
    ours = _model()
    matrices, rest = _split(ours)
    groups = [{"params": matrices}, {"params": rest, "use_muon": False, "lr": 1e-2}]
    optimizer = Muon(groups, **muon_args)
    _train(ours, [optimizer])
    for (name, expected), actual in zip(
        reference.named_parameters(), ours.parameters(), strict=True
    ):
        assert torch.equal(actual, expected), name
    state = optimizer.state_dict()["state"]
    assert set(state[0]) == {"momentum_buffer"}
    assert set(state[len(matrices)]) == {"step", "exp_avg", "exp_avg_sq"}
    assert optimizer.param_groups[1]["eps"] == 1e-8  # AdamW's default, not Muon's 1e-7


def test_muon_groups_take_matrices_only() -> None:
    model = _model()
    with pytest.raises(ValueError, match=r"params: Muon steps 2-D matrices only.*use_muon=False"):
        Muon(model.parameters())
    with pytest.raises(ValueError, match="adjust_lr_fn must be"):
        Muon(_split(model)[0], adjust_lr_fn="sqrt")


def test_owners_are_balanced_by_cost_not_count() -> None:
    # One large matrix alone on a rank; the small ones share the other.
    assert plan_owners([1000, 10, 10, 10, 10], 2) == [0, 1, 1, 1, 1]
    assert plan_owners([5, 5, 5, 5], 4) == [0, 1, 2, 3]
    assert plan_owners([1, 2, 3], 1) == [0, 0, 0]
    assert newton_schulz_cost(torch.Size([4, 10])) == 160


def _exchange(rank: int, world: int, kind: str) -> dict[str, Any]:
    mesh = init_device_mesh("cpu", (world,))
    generator = torch.Generator().manual_seed(3)
    wholes = [
        torch.randn(rows, cols, generator=generator) for rows, cols in [(7, 5), (3, 9), (12, 4)]
    ]
    if kind == "rows":  # uneven ranges, one rank holding nothing of the second matrix
        ranges = [[(0, 7), (7, 7)], [(0, 1), (1, 3)], [(0, 5), (5, 12)]]
        if world == 3:
            ranges = [[(0, 2), (2, 7), (7, 7)], [(0, 3), (3, 3), (3, 3)], [(0, 4), (4, 8), (8, 12)]]
        tensors = []
        for whole, rows in zip(wholes, ranges, strict=True):
            start, end = rows[rank]
            plain = DTensor.from_local(
                whole[start:end].clone(),
                mesh,
                [Shard(0)],
                run_check=False,
                shape=whole.shape,
                stride=whole.stride(),
            )
            tensors.append(row_sharded(plain, rows))
    else:  # torch FSDP2's layout: Shard(1), torch.chunk's columns
        tensors = [distribute_tensor(whole, mesh, [Shard(1)]) for whole in wholes]
    layouts = [rows_of(t, f"m{i}") for i, t in enumerate(tensors)]
    computed: list[int] = []

    def compute(index: int, whole: torch.Tensor) -> torch.Tensor:
        computed.append(index)
        return (whole @ whole.T @ whole).to(torch.bfloat16)

    with CommTracer() as tracer:
        rows = map_whole_matrices(layouts, compute, newton_schulz_cost, torch.bfloat16)
    for layout, mine, whole in zip(layouts, rows, wholes, strict=True):
        expected = (whole @ whole.T @ whole).to(torch.bfloat16)
        dim = layout.dim
        start, end = layout.ranges[rank]
        assert torch.equal(mine, expected.narrow(dim, start, end - start))
    held = [
        (layout.ranges[rank][1] - layout.ranges[rank][0]) * whole.numel() // whole.shape[layout.dim]
        for layout, whole in zip(layouts, wholes, strict=True)
    ]
    return {
        "computed": computed,
        "sent": tracer.bytes("all_to_all"),
        "calls": tracer.calls("all_to_all"),
        "held": held,
    }


@pytest.mark.parametrize("world, kind", [(2, "rows"), (3, "rows"), (2, "torch_chunk")])
def test_each_matrix_is_computed_once_and_travels_once_each_way(world: int, kind: str) -> None:
    results = run_distributed(_exchange, world, kind, timeout=120)
    owners = plan_owners(
        [newton_schulz_cost(torch.Size(s)) for s in [(7, 5), (3, 9), (12, 4)]], world
    )
    computed = sorted(i for r in results for i in r["computed"])
    assert computed == [0, 1, 2], "each matrix computed on exactly one rank"
    for rank, result in enumerate(results):
        assert sorted(result["computed"]) == [i for i, o in enumerate(owners) if o == rank]
        assert result["calls"] == 2  # one all-to-all each way for the three matrices
        # What this rank holds of matrices others own goes out once as fp32, and comes back
        # once as bfloat16: nothing else, nothing to itself.
        foreign = sum(h for i, h in enumerate(result["held"]) if owners[i] != rank)
        owned = [i for i, o in enumerate(owners) if o == rank]
        sent_back = sum(
            sum(r["held"][i] for other, r in enumerate(results) if other != rank) for i in owned
        )
        assert result["sent"] == foreign * 4 + sent_back * 2


def _refuses_tensor_parallel(rank: int, world: int) -> str:
    mesh = init_device_mesh("cpu", (1, world), mesh_dim_names=("dp", "tp"))
    weight = distribute_tensor(torch.ones(4, 6), mesh, [Replicate(), Shard(1)])
    try:
        rows_of(weight, "layers.0.proj.weight")
    except ValueError as error:
        return str(error)
    return "accepted"


def test_a_matrix_split_over_tensor_parallel_is_refused_by_name() -> None:
    message = run_distributed(_refuses_tensor_parallel, 2)[0]
    assert "'layers.0.proj.weight'" in message and "tensor or expert parallel" in message
    assert "element-wise optimizer" in message


def test_a_group_given_as_a_generator_keeps_its_parameters() -> None:
    model = _model()
    matrices, rest = _split(model)
    optimizer = Muon([{"params": iter(matrices)}, {"params": rest, "use_muon": False}])
    assert optimizer.param_groups[0]["params"] == matrices
    _train(model, [optimizer], steps=1)
    assert all("momentum_buffer" in optimizer.state[p] for p in matrices)
