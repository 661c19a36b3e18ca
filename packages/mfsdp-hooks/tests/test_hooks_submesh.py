"""``fully_shard(module, mesh=...)`` talks over the mesh's groups only, as FSDP2 does.

Four ranks split into two pairs (one dim of a 2x2 mesh). Only the pair {2, 3} trains (global
rank != mesh rank); the pair {0, 1} only waits on a barrier over its own group at the end. A
collective on the default group by the training pair then hangs or fails (the idle pair never
joins it), and a global rank taken for a mesh rank breaks parity with one process. Covers
wrap, forward, backward, the first step's optimizer attach and ``state_dict``, the blocks with
``reshard_after_forward=2`` (a post-forward subgroup cut from the pair), and the
wrap-time INFO log, written by the mesh's first rank (global rank 2), not global rank 0.
"""

from __future__ import annotations

import logging
from typing import Any

import pytest
import torch

from mfsdp_collectives.testing import run_distributed
from mfsdp_hooks.testing import make_batches, make_model, train_data_parallel, train_single_process

STEPS = 3
TRAINING_PAIR = 1  # the pair of global ranks {2, 3}


def _pair_mesh() -> Any:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pair", "dp_shard"))
    return mesh["dp_shard"], mesh.get_coordinate()


def _reference() -> tuple[list[float], dict[str, torch.Tensor]]:
    model = make_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = train_single_process(model, optimizer, make_batches(STEPS))
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


def _worker(rank: int, world: int) -> dict[str, Any]:
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    from mfsdp_hooks import fully_shard

    shard_mesh, (pair, mesh_rank) = _pair_mesh()
    if pair != TRAINING_PAIR:
        dist.barrier(group=shard_mesh.get_group())
        return {}
    logged: list[logging.LogRecord] = []
    log = logging.getLogger("mfsdp_hooks.observe")
    log.setLevel(logging.INFO)
    handler = logging.Handler(logging.INFO)
    handler.emit = logged.append  # type: ignore[assignment, method-assign]
    log.addHandler(handler)
    model = make_model()
    for block in model.blocks:
        fully_shard(block, mesh=shard_mesh, reshard_after_forward=2)
    fully_shard(model, mesh=shard_mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = train_data_parallel(model, optimizer, make_batches(STEPS), mesh_rank, 2)
    state = {
        k: (v.full_tensor() if isinstance(v, DTensor) else v).tolist()
        for k, v in model.state_dict().items()
    }
    return {"mesh_rank": mesh_rank, "losses": losses, "state": state, "logged": len(logged)}


def test_fully_shard_on_a_submesh_uses_only_its_groups() -> None:
    results = run_distributed(_worker, 4, timeout=90)
    ref_losses, ref_state = _reference()
    assert results[0] == results[1] == {}
    # Each rank's loss is its half-batch's; their mean is the whole batch's.
    pair = zip(results[2]["losses"], results[3]["losses"], strict=True)
    assert [(a + b) / 2 for a, b in pair] == pytest.approx(ref_losses, rel=1e-5, abs=1e-6)
    for rank in (2, 3):
        got = results[rank]
        assert got["mesh_rank"] == rank - 2
        # One line per unit (3 blocks and the root) and a total, on the mesh's first rank only.
        assert got["logged"] == (5 if rank == 2 else 0), (rank, got["logged"])
        assert got["state"].keys() == ref_state.keys()
        for key, expected in ref_state.items():
            actual = torch.tensor(got["state"][key])
            torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-6)
