"""Strict asynchronous collectives: a read before the wait is NaN, a reuse in flight raises."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from mfsdp_buffers import PlainAllocator, poisoning_enabled, release_to
from mfsdp_collectives import (
    ReduceSpec,
    all_gather_into,
    all_reduce_,
    enable_host_transport,
    reduce_scatter_into,
    strict_async,
    strict_async_enabled,
)
from mfsdp_collectives.testing import run_distributed, run_distributed_outcomes


def _group(transport: str) -> tuple[dist.ProcessGroup, object]:
    group = dist.new_group(list(range(dist.get_world_size())))
    return group, enable_host_transport(group, transport)


def _reads_before_wait(rank: int, world: int, transport: str) -> None:
    group, shm = _group(transport)
    shard = torch.full((3,), float(rank + 1))
    out = torch.zeros(3 * world)
    grads = torch.arange(4.0 * world) + rank
    reduced = torch.ones(4)
    ints = torch.zeros(2 * world, dtype=torch.int64)
    with strict_async():
        assert strict_async_enabled() and poisoning_enabled()
        gather = all_gather_into(shard, out, group, transport=shm)  # type: ignore[arg-type]
        assert torch.isnan(out).all(), "the output is poisoned until the wait"
        assert not gather.is_completed(), "only wait() runs a strict collective"
        scatter = reduce_scatter_into(
            grads,
            reduced,
            group,
            spec=ReduceSpec(average=False),
            accumulate=True,
            transport=shm,  # type: ignore[arg-type]
        )
        assert torch.isnan(reduced).all()
        int_gather = all_gather_into(torch.full((2,), rank), ints, group)
        assert (ints == torch.iinfo(torch.int64).max).all(), "integers get their dtype's max"
        # Waited in another order than issued: every rank does the same, so this is fine.
        int_gather.wait()
        scatter.wait()
        gather.wait()
    assert not strict_async_enabled() and not poisoning_enabled()
    assert out.tolist() == [float(r + 1) for r in range(world) for _ in range(3)]
    want = sum(torch.arange(4.0 * world) + r for r in range(world))[rank * 4 : (rank + 1) * 4]
    assert torch.equal(reduced, 1 + want), "accumulate adds to what was there before launch"
    assert ints.tolist() == [r for r in range(world) for _ in range(2)]


@pytest.mark.parametrize("transport", ["gloo", "shm"])
def test_a_read_before_the_wait_sees_poison_and_the_wait_brings_the_result(transport: str) -> None:
    run_distributed(_reads_before_wait, 2, transport, timeout=60)


def _in_place_and_nan_inputs(rank: int, world: int) -> None:
    group, _ = _group("gloo")
    full = torch.full((2 * world,), float("nan"))
    mine = full[rank * 2 : (rank + 1) * 2]
    mine.copy_(torch.tensor([float(rank), float("nan")]))  # a NaN input is data, not poison
    summed = torch.tensor([1.0, float(rank)])
    with strict_async():
        gather = all_gather_into(mine, full, group)
        reduce = all_reduce_(summed, group, spec=ReduceSpec(average=False))
        gather.wait()
        reduce.wait()
    assert full[0::2].tolist() == [float(r) for r in range(world)]
    assert torch.isnan(full[1::2]).all()
    assert summed.tolist() == [float(world), float(sum(range(world)))]


def test_in_place_gathers_and_nan_inputs_are_not_mistaken_for_misuse() -> None:
    run_distributed(_in_place_and_nan_inputs, 2, timeout=60)


def _misuse(rank: int, world: int, what: str) -> str:
    group, _ = _group("gloo")
    shard = torch.ones(4)
    out = torch.empty(4 * world)
    with strict_async():
        handle = all_gather_into(shard, out, group)
        if what == "input":
            shard.add_(1.0)  # overwritten while the collective may still read it
        else:
            out.zero_()  # reused before the collective finished writing it
        try:
            handle.wait()
        except RuntimeError as exc:
            return str(exc)
    return "no error"


@pytest.mark.parametrize(
    ("what", "says"),
    [("input", "changed between launch and wait"), ("output", "written before its handle")],
)
def test_a_buffer_reused_in_flight_raises_naming_the_collective(what: str, says: str) -> None:
    for outcome in run_distributed_outcomes(_misuse, 2, what, timeout=60):
        assert outcome.error is None, outcome.error
        assert says in str(outcome.result)
        assert "all_gather" in str(outcome.result)


def test_released_buffers_are_poisoned_only_in_strict_mode() -> None:
    allocator = PlainAllocator()
    kept = allocator.allocate("k", 4, torch.float32, torch.device("cpu")).fill_(1.0)
    release_to(allocator, "k", kept)
    assert kept.tolist() == [1.0] * 4
    with strict_async():
        released = allocator.allocate("k", 4, torch.float32, torch.device("cpu")).fill_(1.0)
        view = released[1:3]
        release_to(allocator, "k", released)
    assert torch.isnan(view).all(), "a stale view of a released buffer reads NaN"
