"""Behaviours torch's own FSDP2 tests expect of the per-module API, side by side with FSDP2.

Each failed before (issue: seams, item 10): a ``DeviceMesh`` without dim names (FSDP2's
canonical ``init_device_mesh("cpu", (world,))``) was refused; ``set_requires_gradient_sync``
had no ``recurse``; there was no ``reset_iter_state`` and an exception mid-forward left the
units in FORWARD, so the next iteration raised "illegal state change".
"""

from __future__ import annotations

import pytest
import torch
from hooks_models import make_batches, make_model, shard_blocks_then_root, train_data_parallel
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

from mfsdp_collectives.testing import run_distributed
from mfsdp_hooks import fully_shard

STEPS = 5


def _unnamed_mesh_worker(rank: int, world: int, impl: str) -> list[float]:
    mesh = init_device_mesh("cpu", (world,))  # no mesh_dim_names
    model = make_model()
    shard_blocks_then_root(model, impl, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=False)
    return train_data_parallel(model, optimizer, make_batches(STEPS), rank, world, global_mean=True)


def test_a_1d_mesh_without_dim_names_shards_as_fsdp2_does() -> None:
    ours = run_distributed(_unnamed_mesh_worker, 2, "ours", timeout=120)[0]
    theirs = run_distributed(_unnamed_mesh_worker, 2, "fsdp2", timeout=120)[0]
    assert ours == pytest.approx(theirs, rel=1e-5)


def _unnamed_2d_worker(rank: int, world: int) -> None:
    with pytest.raises(ValueError, match="needs dim names"):
        fully_shard(make_model(), mesh=init_device_mesh("cpu", (2, 2)))


def test_a_2d_mesh_without_dim_names_is_refused_as_fsdp2_refuses_it() -> None:
    run_distributed(_unnamed_2d_worker, 4, timeout=120)


class _Fails(nn.Module):
    """Raises in forward when armed: an exception in the middle of an iteration."""

    armed = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.armed:
            raise ValueError("boom")
        return x


def _reset_worker(rank: int, world: int, impl: str) -> list[float]:
    model = make_model()
    fails = _Fails()
    model.blocks[1].register_forward_pre_hook(lambda m, args: (fails(args[0]),))
    shard_blocks_then_root(model, impl)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=False)
    batches = make_batches(STEPS)
    losses = train_data_parallel(model, optimizer, batches[:2], rank, world, global_mean=True)
    fails.armed = True
    tokens, _ = batches[2]
    with pytest.raises(ValueError, match="boom"):
        model(tokens)
    fails.armed = False
    model.reset_iter_state()  # type: ignore[operator]
    return losses + train_data_parallel(
        model, optimizer, batches[2:], rank, world, global_mean=True
    )


def test_reset_iter_state_after_an_exception_in_forward() -> None:
    ours = run_distributed(_reset_worker, 2, "ours", timeout=120)[0]
    theirs = run_distributed(_reset_worker, 2, "fsdp2", timeout=120)[0]
    assert ours == pytest.approx(theirs, rel=1e-5)


def _recurse_worker(rank: int, world: int) -> list[bool]:
    model = make_model()
    shard_blocks_then_root(model, "ours")
    model.set_requires_gradient_sync(False, recurse=False)  # type: ignore[operator]
    alone = [b.requires_gradient_sync for b in model.blocks]  # type: ignore[union-attr]
    root_alone = model.requires_gradient_sync  # type: ignore[operator]
    model.set_requires_gradient_sync(False, recurse=True)  # type: ignore[operator]
    everywhere = [b.requires_gradient_sync for b in model.blocks]  # type: ignore[union-attr]
    return [root_alone, *alone, *everywhere]


def test_set_requires_gradient_sync_takes_recurse() -> None:
    flags = run_distributed(_recurse_worker, 2, timeout=60)[0]
    assert flags == [False, True, True, True, False, False, False]
