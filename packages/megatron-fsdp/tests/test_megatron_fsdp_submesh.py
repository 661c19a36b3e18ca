"""The seed API given a mesh (``fully_shard(model, optimizer, device_mesh=..., dp_shard_dim=...)``)
talks over its groups only.

Four ranks, two pairs (a 2x2 mesh's ``dp_shard`` dim); the pair {2, 3} trains (global rank !=
mesh rank) while the pair {0, 1} only waits on a barrier over its own group at the end: a
collective on the default group by the training pair would hang or fail, and a global rank
taken for a mesh rank would break parity with one process.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from mfsdp_collectives.testing import run_distributed
from mfsdp_hooks.testing import (
    Block,
    make_batches,
    make_model,
    train_data_parallel,
    train_single_process,
)

STEPS = 3


def _worker(rank: int, world: int) -> dict[str, Any]:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    from megatron_fsdp import fully_shard

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pair", "dp_shard"))
    coordinate = mesh.get_coordinate()
    assert coordinate is not None
    pair, mesh_rank = coordinate
    if pair == 0:
        dist.barrier(group=mesh["dp_shard"].get_group())
        return {}
    original = make_model()
    model, optimizer = fully_shard(
        original,
        torch.optim.AdamW(original.parameters(), lr=1e-2),
        fsdp_unit_modules=[Block],
        device_mesh=mesh,
        dp_shard_dim="dp_shard",
    )
    losses = train_data_parallel(model, optimizer, make_batches(STEPS), mesh_rank, 2)
    state = {
        k.removeprefix("module."): (v.full_tensor() if isinstance(v, DTensor) else v).tolist()
        for k, v in model.state_dict().items()
    }
    return {"mesh_rank": mesh_rank, "losses": losses, "state": state}


def test_seed_api_on_a_submesh_uses_only_its_groups() -> None:
    results = run_distributed(_worker, 4, timeout=90)
    reference = make_model()
    ref_losses = train_single_process(
        reference, torch.optim.AdamW(reference.parameters(), lr=1e-2), make_batches(STEPS)
    )
    assert results[0] == results[1] == {}
    pair = zip(results[2]["losses"], results[3]["losses"], strict=True)
    assert [(a + b) / 2 for a, b in pair] == pytest.approx(ref_losses, rel=1e-5, abs=1e-6)
    expected = reference.state_dict()
    for rank in (2, 3):
        got = results[rank]
        assert got["mesh_rank"] == rank - 2
        assert got["state"].keys() == expected.keys()
        for key, value in expected.items():
            actual = torch.tensor(got["state"][key])
            torch.testing.assert_close(actual, value, rtol=1e-5, atol=1e-6)
