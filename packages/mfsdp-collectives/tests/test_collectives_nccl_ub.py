"""NCCL user buffers: a warned no-op off NCCL/CUDA; registration on CUDA."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.distributed as dist

import mfsdp_collectives.topology.nccl_ub as nccl_ub
from mfsdp_collectives import UserBufferPool, all_gather_into, register_user_buffers
from mfsdp_collectives.testing import run_distributed


def _gloo_world(rank: int, ws: int) -> list[int]:
    group = dist.group.WORLD
    assert group is not None
    counts = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        pool = UserBufferPool(group, enabled=True, device="cpu")
        counts.append(len([w for w in caught if "no effect" in str(w.message)]))
        assert "'gloo'" in str(caught[0].message)
        again = register_user_buffers(group, enabled=True, symmetric=False, device="cpu")
        off = UserBufferPool(group, enabled=False)
        counts.append(len([w for w in caught if "no effect" in str(w.message)]))
    assert not pool.active and not again.active and not off.active
    with pool.allocation_context():
        shard = torch.full((3,), float(rank))
        full = torch.empty(3 * ws)
    pool.register()
    pool.deregister()
    all_gather_into(shard, full, group).wait()
    assert torch.equal(full, torch.arange(ws, dtype=torch.float32).repeat_interleave(3))
    return counts


def test_user_buffers_warn_once_and_do_nothing_on_gloo() -> None:
    assert run_distributed(_gloo_world, 2, timeout=60) == [[1, 1], [1, 1]]


def _nccl_world(rank: int, ws: int) -> tuple[bool, bool, list[str]]:
    """Registers where this NCCL can; else checks the warned fallback still gathers right."""
    device = torch.device("cuda", torch.cuda.current_device())
    group = dist.group.WORLD
    assert group is not None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        pool = UserBufferPool(group, enabled=True, device=device)
    said = [str(w.message) for w in caught]
    with pool.allocation_context():
        shard = torch.full((1024,), float(rank), device=device)
        full = torch.empty(1024 * ws, device=device)
    all_gather_into(shard, full, group).wait()
    torch.accelerator.synchronize()
    expected = torch.arange(ws, device=device, dtype=torch.float32).repeat_interleave(1024)
    ok = bool(torch.equal(full, expected))
    pool.deregister()
    return pool.active, ok, said


@pytest.mark.cuda
def test_user_buffers_register_on_nccl() -> None:
    if not torch.cuda.is_available() or not dist.is_nccl_available():
        pytest.skip("needs CUDA and NCCL: user-buffer registration is NCCL-only")
    ws = min(2, torch.cuda.device_count())
    results = run_distributed(_nccl_world, ws, backend="nccl", timeout=120)
    for active, ok, said in results:
        assert ok, "the all-gather through the pool's buffers is wrong"
        if active:
            assert said == [], f"registration warned although it is active: {said}"
        else:
            # The NCCL build lacks ncclMemAlloc: one warning saying so, nothing else.
            assert len(said) == 1 and "no effect" in said[0], said
    if not all(active for active, _, _ in results):
        reason = results[0][2]
        pytest.skip(f"this NCCL cannot register user buffers ({reason}); the fallback passed")


def test_warn_once_registry_is_per_reason() -> None:
    nccl_ub._warned.discard("test-reason")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        nccl_ub._warn_once("test-reason", "first")
        nccl_ub._warn_once("test-reason", "second")
    assert [str(w.message) for w in caught] == ["first"]
