"""A rank that dies is named by its peers within seconds, on every transport; collectives
are visible to ``torch.profiler`` on every transport.

Each world kills one rank with SIGKILL (no Python cleanup, no socket shutdown message: what
the OOM killer does) while the others are inside, or about to enter, a collective with it.
"""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest
import torch
import torch.distributed as dist
from torch.autograd.profiler import record_function

from mfsdp_collectives import (
    BlockQuantization,
    PeerDiedError,
    QuantizedAllGather,
    QuantizedReduceScatter,
    all_gather_into,
    dead_ranks,
    enable_host_transport,
    exchange_identities,
    host_transport_of,
    reduce_scatter_into,
)
from mfsdp_collectives.testing import run_distributed, run_distributed_outcomes

RAISE_WITHIN_S = 5.0


def _die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def _collective_with_a_dead_peer(rank: int, world: int, transport: str, victim: int) -> str:
    group = dist.new_group(list(range(world)))
    enable_host_transport(group, transport)
    exchange_identities(group)
    shard = torch.full((1 << 16,), float(rank))
    out = torch.empty(shard.numel() * world)
    all_gather_into(
        shard, out, group, transport=host_transport_of(group)
    ).wait()  # the world works before the fault
    if rank == victim:
        time.sleep(0.3)  # the peers are waiting inside the next collective by now
        _die()
    for _ in range(3):  # a survivor that missed the death in one op meets it in the next
        reduce_scatter_into(
            out, torch.empty_like(shard), group, transport=host_transport_of(group)
        ).wait()
        all_gather_into(shard, out, group, transport=host_transport_of(group)).wait()
    return "the collectives finished although a peer died"


@pytest.mark.parametrize("transport", ["shm", "gloo"])
@pytest.mark.parametrize(("world", "victim"), [(2, 1), (4, 2)])
def test_survivors_name_the_dead_rank_within_seconds(
    transport: str, world: int, victim: int
) -> None:
    outcomes = run_distributed_outcomes(
        _collective_with_a_dead_peer, world, transport, victim, timeout=60
    )
    death = outcomes[victim]
    assert death.died, death
    for outcome in outcomes:
        if outcome.rank == victim:
            continue
        assert outcome.error is not None, f"rank {outcome.rank}: {outcome.result}"
        original = outcome.error.exception
        assert isinstance(original, PeerDiedError), outcome.error
        assert victim in original.ranks, original
        assert f"rank {victim} (pid" in str(original), original
        delay = outcome.at - death.at
        assert delay < RAISE_WITHIN_S, f"rank {outcome.rank} raised {delay:.1f}s after the death"


def _dead_ranks_world(rank: int, world: int) -> list[int]:
    exchange_identities(dist.group.WORLD)
    assert dead_ranks() == []
    dist.barrier()  # both looked before rank 1 dies
    if rank == 1:
        _die()
    deadline = time.monotonic() + RAISE_WITHIN_S
    while time.monotonic() < deadline:
        found = dead_ranks()
        if found:
            return found
        time.sleep(0.05)
    return []


def test_dead_ranks_sees_a_killed_peer_without_any_collective() -> None:
    outcomes = run_distributed_outcomes(_dead_ranks_world, 2, timeout=60)
    assert outcomes[1].died
    assert outcomes[0].error is None, outcomes[0].error
    assert outcomes[0].result == [1]


def _profiler_records_ranges_closed_on_another_thread() -> bool:
    """The shm transport opens each range on the issuing thread and closes it on its worker."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        span = record_function("mfsdp_probe")
        span.__enter__()  # type: ignore[no-untyped-call]
        closer = threading.Thread(target=span.__exit__, args=(None, None, None))
        closer.start()
        closer.join()
    return any(event.name == "mfsdp_probe" for event in prof.events())


def _profiled(rank: int, world: int, transport: str) -> list[str]:
    group = dist.new_group(list(range(world)))
    enable_host_transport(group, transport)
    shard = torch.ones(1000)
    out = torch.empty(shard.numel() * world)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        all_gather_into(shard, out, group, transport=host_transport_of(group)).wait()
        reduce_scatter_into(
            out, torch.empty_like(shard), group, transport=host_transport_of(group)
        ).wait()
    return [event.name for event in prof.events()]


@pytest.mark.parametrize(
    ("transport", "gather", "scatter"),
    [
        (
            "shm",
            "mfsdp_shm:all_gather (group=pg[0,1], bytes=4000)",
            "mfsdp_shm:reduce_scatter (group=pg[0,1], bytes=8000)",
        ),
        ("gloo", "gloo:all_gather", "gloo:all_reduce"),  # gloo reduce-scatters by all-reduce
    ],
)
def test_collectives_appear_in_the_profiler(transport: str, gather: str, scatter: str) -> None:
    if transport == "shm" and not _profiler_records_ranges_closed_on_another_thread():
        pytest.skip(
            f"torch {torch.__version__}'s profiler drops a range closed on another thread "
            "(2.11 does; 2.13 records it): the shared-memory ranges need a newer torch"
        )
    for names in run_distributed(_profiled, 2, transport, timeout=60):
        assert names.count(gather) == 1, [n for n in set(names) if "aten" not in n]
        assert names.count(scatter) == 1, sorted(set(names))


def _quantized_with_a_dead_peer(rank: int, world: int, background: bool) -> str:
    group = dist.new_group(list(range(world)))
    exchange_identities(group)
    spec = BlockQuantization(block=256)
    gather = QuantizedAllGather(spec, background=background)
    scatter = QuantizedReduceScatter(spec, background=background)
    shard = torch.full((1 << 16,), float(rank))
    out = torch.empty(shard.numel() * world)
    all_gather_into(shard, out, group, comm=gather).wait()  # the world works before the fault
    if rank == 1:
        time.sleep(0.3)  # the peers are waiting inside the next collective by now
        _die()
    for _ in range(3):
        reduce_scatter_into(out, torch.empty_like(shard), group, comm=scatter).wait()
        all_gather_into(shard, out, group, comm=gather).wait()
    return "the collectives finished although a peer died"


@pytest.mark.parametrize("background", [True, False], ids=["worker_thread", "calling_thread"])
def test_a_dead_peer_of_a_quantized_collective_is_named_within_seconds(background: bool) -> None:
    """The quantized comms exchange over c10d, on their worker's private group or this
    thread's: either way the survivor names the dead rank instead of waiting on it."""
    outcomes = run_distributed_outcomes(_quantized_with_a_dead_peer, 2, background, timeout=60)
    death, survivor = outcomes[1], outcomes[0]
    assert death.died, death
    assert survivor.error is not None, survivor.result
    original = survivor.error.exception
    assert isinstance(original, PeerDiedError), survivor.error
    assert "rank 1 (pid" in str(original), original
    delay = survivor.at - death.at
    assert delay < RAISE_WITHIN_S, f"the survivor raised {delay:.1f}s after the death"
