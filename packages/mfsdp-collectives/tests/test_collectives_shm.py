"""The shared-memory host transport: same results as gloo, bounded staging, clear failures.

Every collective is run twice on the same inputs, once through the transport and once
through gloo itself (a second group over the same ranks keeps gloo's path), and the two
results are compared exactly: the transport adds the ranks' pieces in rank order, so sums
of two terms are bitwise equal and longer sums agree to rounding.
"""

from __future__ import annotations

import os
import threading
import time
from typing import Any

import pytest
import torch
import torch.distributed as dist

from mfsdp_buffers import FlatPieces, LiveTensorTracker
from mfsdp_collectives import (
    CommTracer,
    FSDPTopology,
    ReduceSpec,
    all_gather_into,
    disable_host_transport,
    enable_host_transport,
    host_transport_of,
    reduce_scatter_into,
)
from mfsdp_collectives.host.host_transport import _HostFacts, _unsuitable
from mfsdp_collectives.safety.liveness import ProcessIdentity
from mfsdp_collectives.testing import run_distributed

CHUNK = 4096  # forces many steps and a ragged last one on the sizes below


def _inputs(world: int, numel: int, dtype: torch.dtype, seed: int) -> list[torch.Tensor]:
    return [
        torch.randn(numel, generator=torch.Generator().manual_seed(seed * 100 + r)).to(dtype)
        for r in range(world)
    ]


def _same_as_gloo(rank: int, world: int) -> int:
    shm_group = dist.new_group(list(range(world)))
    gloo_group = dist.new_group(list(range(world)))
    transport = enable_host_transport(shm_group, "shm", chunk_bytes=CHUNK)
    assert transport is not None and host_transport_of(shm_group) is transport
    assert host_transport_of(gloo_group) is None
    assert enable_host_transport(shm_group, "auto") is transport  # idempotent, no collective
    checked = 0
    for dtype in (torch.float32, torch.bfloat16):
        for numel in (1, 1000, 3 * CHUNK + 17):
            shards = _inputs(world, numel, dtype, seed=numel)
            results = []
            for group in (shm_group, gloo_group):
                out = torch.full((numel * world,), float("nan"), dtype=dtype)
                all_gather_into(shards[rank], out, group, transport=host_transport_of(group)).wait()
                results.append(out)
            assert torch.equal(results[0], torch.cat(shards))
            assert torch.equal(results[0], results[1])
            # in place: the shard already sits in its slot of the unsharded buffer
            inplace = torch.cat(shards).clone()
            inplace[: rank * numel].fill_(float("nan"))
            inplace[(rank + 1) * numel :].fill_(float("nan"))
            mine = inplace[rank * numel : (rank + 1) * numel]
            all_gather_into(mine, inplace, shm_group, transport=host_transport_of(shm_group)).wait()
            assert torch.equal(inplace, torch.cat(shards))

            grads = _inputs(world, numel * world, dtype, seed=numel + 7)
            for kwargs in (
                {"average": True},
                {"average": False},
                {"average": True, "pre_scale": 0.5, "post_scale": 3.0},
                {"average": True, "reduce_dtype": torch.float32},
            ):
                outs = []
                for group in (shm_group, gloo_group):
                    out = torch.ones(numel, dtype=dtype)
                    reduce_scatter_into(
                        grads[rank],
                        out,
                        group,
                        transport=host_transport_of(group),
                        accumulate=True,
                        spec=ReduceSpec(**kwargs),
                    ).wait()
                    outs.append(out)
                expected = torch.stack([g.float() for g in grads]).sum(0)
                if kwargs.get("average"):
                    expected /= world
                expected = expected * kwargs.get("pre_scale", 1.0) * kwargs.get("post_scale", 1.0)
                want = 1 + expected[rank * numel : (rank + 1) * numel]
                if dtype == torch.bfloat16:
                    # summed in fp32 and rounded once (then once more by accumulate), where
                    # gloo rounds after every addition
                    torch.testing.assert_close(outs[0].float(), want, rtol=8e-3, atol=1.6e-2)
                    torch.testing.assert_close(outs[1].float(), want, rtol=0.05, atol=0.05)
                elif world == 2:
                    assert torch.equal(outs[0], outs[1])  # a + b: no order to disagree on
                else:
                    torch.testing.assert_close(outs[0], outs[1], rtol=1e-5, atol=1e-6)
                checked += 1
    return checked


@pytest.mark.parametrize("world", [2, 4])
def test_results_match_gloo_exactly_or_to_rounding(world: int) -> None:
    assert run_distributed(_same_as_gloo, world, timeout=240) == [24] * world


def _as_pieces(dense: torch.Tensor, dtype: torch.dtype) -> tuple[FlatPieces, torch.Tensor]:
    """Irregular pieces of ``dense`` with zeroed gaps between them, and the dense equivalent."""
    numel, pieces, cursor, size = dense.numel(), [], 0, 1
    with_gaps = torch.zeros_like(dense)
    while cursor < numel:
        end = min(cursor + size, numel)
        pieces.append((cursor, dense[cursor:end].to(dtype)))
        with_gaps[cursor:end] = dense[cursor:end].to(dtype).to(dense.dtype)
        cursor, size = end + size % 5, size * 3 + 1  # a gap of 0-4 elements after each
    return FlatPieces(numel, pieces, dtype=dense.dtype, device=dense.device), with_gaps


def _pieces_same_as_dense(rank: int, world: int) -> int:
    shm_group = dist.new_group(list(range(world)))
    gloo_group = dist.new_group(list(range(world)))
    enable_host_transport(shm_group, "shm", chunk_bytes=CHUNK)
    numel = 3 * CHUNK + 17
    checked = 0
    for piece_dtype in (torch.float32, torch.bfloat16):
        for kwargs in ({"average": True}, {"average": False, "post_scale": 0.25}):
            for group in (shm_group, gloo_group):
                outs, added = [], []
                # Everything is made under the tracker, which counts a storage made before it
                # opened as new when an op first touches it.
                with LiveTensorTracker() as mem:
                    grad = _inputs(world, numel * world, torch.float32, seed=11)[rank]
                    pieces, dense = _as_pieces(grad, piece_dtype)
                    for inp in (pieces, dense):
                        out = torch.ones(numel)
                        before = mem.live
                        mem.reset_phase()
                        with CommTracer() as tracer:
                            reduce_scatter_into(
                                inp,
                                out,
                                group,
                                transport=host_transport_of(group),
                                accumulate=True,
                                spec=ReduceSpec(**kwargs),
                            ).wait()
                        added.append(mem.phase_peak - before)
                        outs.append(out)
                        sent = sum(e["bytes"] for e in tracer.summary().values())
                        assert sent == numel * world * 4
                assert torch.equal(outs[0], outs[1])
                if group is shm_group:  # read (and cast) straight from the pieces
                    assert added[0] <= numel * 4, added  # at most the receive buffer
                else:  # gloo needs the whole flat input first
                    assert added[0] >= numel * world * 4, added
                checked += 1
    return checked


def test_reduce_scatter_of_flat_pieces_equals_the_dense_input() -> None:
    assert run_distributed(_pieces_same_as_dense, 2, timeout=120) == [8, 8]


def _many_in_flight(rank: int, world: int) -> list[float]:
    group = dist.group.WORLD
    assert group is not None
    enable_host_transport(group, "shm", chunk_bytes=CHUNK)
    numel = 2 * CHUNK
    shards = _inputs(world, numel, torch.float32, seed=3)
    grads = _inputs(world, numel * world, torch.float32, seed=4)
    gathers = [torch.empty(numel * world) for _ in range(3)]
    reduced = [torch.empty(numel) for _ in range(3)]
    with CommTracer() as tracer:
        handles = []
        for i in range(3):
            handles.append(
                all_gather_into(
                    shards[rank] + i, gathers[i], group, transport=host_transport_of(group)
                )
            )
            handles.append(
                reduce_scatter_into(
                    grads[rank] * (i + 1), reduced[i], group, transport=host_transport_of(group)
                )
            )
        for handle in reversed(handles):  # waiting out of order is fine: they run in order
            handle.wait()
    totals: dict[str, dict[str, int]] = {}
    for key, entry in tracer.summary().items():
        totals[key.rsplit("/", 1)[1]] = entry
    assert totals["all_gather"] == {"calls": 3, "bytes": 3 * numel * 4}
    assert totals["reduce_scatter"] == {"calls": 3, "bytes": 3 * numel * world * 4}
    mean = torch.stack(grads).mean(0)[rank * numel : (rank + 1) * numel]
    for i in range(3):
        assert torch.equal(gathers[i], torch.cat(shards) + i)
        torch.testing.assert_close(reduced[i], mean * (i + 1))
    return [float(reduced[2].sum())]


def test_async_ops_in_flight_complete_in_issue_order_and_are_counted() -> None:
    run_distributed(_many_in_flight, 2, timeout=120)


def _mailboxes_leave_no_files(rank: int, world: int) -> int:
    group = dist.group.WORLD
    assert group is not None
    before = set(os.listdir("/dev/shm"))
    transport = enable_host_transport(group, "auto")
    assert transport is not None
    assert transport.mapped_bytes == 2 * (64 + 2 * transport.chunk_bytes)  # two lanes
    dist.barrier()
    leaked = {f for f in set(os.listdir("/dev/shm")) - before if f.startswith("mfsdp-")}
    assert not leaked, leaked
    assert enable_host_transport(dist.new_group([0, 1]), "gloo") is None
    return 1


@pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="needs /dev/shm")
def test_auto_takes_shared_memory_on_one_host_and_unlinks_the_mailboxes() -> None:
    run_distributed(_mailboxes_leave_no_files, 2, timeout=60)


def _topology_with_transport(rank: int, world: int) -> str:
    built = FSDPTopology.default("cpu")
    chosen = built.with_host_transport("auto")
    assert built.host_transport is None, "the built topology is left as it is"
    assert chosen.host_transport is host_transport_of(built.shard_group) is not None
    assert chosen.shard_group is built.shard_group and chosen.device == built.device
    assert built.with_host_transport("shm").host_transport is chosen.host_transport
    with pytest.raises(ValueError, match="already put this shard group's collectives"):
        built.with_host_transport("gloo")
    return "ok"


@pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="needs /dev/shm")
def test_a_topology_with_its_transport_chosen_is_a_new_topology() -> None:
    assert run_distributed(_topology_with_transport, 2, timeout=60) == ["ok", "ok"]


def _peer_stops_issuing(rank: int, world: int) -> str:
    group = dist.group.WORLD
    assert group is not None
    enable_host_transport(group, "shm", timeout_s=2.0)
    if rank == 1:
        time.sleep(4.0)  # alive but silent: a rank that died would be named instead
        return "skipped"
    out = torch.empty(8 * world)
    try:
        all_gather_into(torch.ones(8), out, group, transport=host_transport_of(group)).wait()
    except TimeoutError as exc:
        return str(exc)
    return "no error"


def test_a_rank_that_stops_issuing_collectives_is_a_timeout_not_a_hang() -> None:
    message, skipped = run_distributed(_peer_stops_issuing, 2, timeout=60)
    assert skipped == "skipped"
    assert "waited 2s for rank 1" in message and "different order" in message


def _bad_choice(rank: int, world: int) -> str:
    group = dist.group.WORLD
    assert group is not None
    for kwargs, fragment in (
        ({"transport": "nvlink"}, "host_transport='nvlink' is not one of"),
        ({"transport": "shm", "chunk_bytes": 100}, "chunk_bytes=100 must be"),
    ):
        with pytest.raises(ValueError, match=fragment):
            enable_host_transport(group, **kwargs)  # type: ignore[arg-type]
    return "ok"


def test_bad_choices_raise_before_any_collective() -> None:
    # rank 1 never calls a collective: a check that communicated first would hang it
    assert run_distributed(_bad_choice, 2, timeout=60) == ["ok", "ok"]


def _fact(host: str = "h/boot", arch_ok: bool = True, path: str | None = "/p") -> _HostFacts:
    return _HostFacts(process=ProcessIdentity(host, 1, 1), arch_ok=arch_ok, path=path)


def test_groups_that_do_not_qualify_are_named_with_the_reason() -> None:
    assert _unsuitable([_fact(), _fact()]) is None
    assert "more than one host" in str(_unsuitable([_fact(), _fact(host="other/boot")]))
    assert "x86-64" in str(_unsuitable([_fact(), _fact(arch_ok=False)]))
    assert "mailbox" in str(_unsuitable([_fact(), _fact(path=None)]))


def _one_rank_cannot_map(rank: int, world: int) -> list[str]:
    import mfsdp_collectives.host.shm_lane as shm_lane

    real = shm_lane.MailboxFile.__init__

    def refuse_peers(self: object, path: str, slot_bytes: int, lanes: int, *, create: bool) -> None:
        if not create:
            raise PermissionError(13, "Permission denied")
        real(self, path, slot_bytes, lanes, create=create)  # type: ignore[arg-type]

    if rank == 1:
        shm_lane.MailboxFile.__init__ = refuse_peers  # type: ignore[method-assign]
    outcomes = []
    group = dist.new_group(list(range(world)))
    outcomes.append("gloo" if enable_host_transport(group, "auto") is None else "shm")
    strict = dist.new_group(list(range(world)))
    try:
        enable_host_transport(strict, "shm")
        outcomes.append("no error")
    except ValueError as exc:
        outcomes.append(str(exc))
    # the groups still work, through gloo
    out = torch.empty(2 * world)
    all_gather_into(
        torch.full((2,), float(rank)), out, group, transport=host_transport_of(group)
    ).wait()
    assert out.tolist() == [float(r) for r in range(world) for _ in range(2)]
    return outcomes


def test_a_rank_that_cannot_map_a_mailbox_makes_every_rank_keep_gloo() -> None:
    for auto, strict in run_distributed(_one_rank_cannot_map, 2, timeout=60):
        assert auto == "gloo"
        assert "rank 1:" in strict and "Permission denied" in strict and "'gloo'" in strict


def _disable_then_enable(rank: int, world: int) -> list[int]:
    group = dist.new_group(list(range(world)))
    shards = _inputs(world, 3 * CHUNK, torch.float32, seed=5)
    expected = torch.cat(shards)
    threads = []
    for _ in range(2):
        transport = enable_host_transport(group, "shm", chunk_bytes=CHUNK)
        assert transport is not None
        out = torch.empty_like(expected)
        handle = all_gather_into(shards[rank], out, group, transport=host_transport_of(group))
        disable_host_transport(group)  # the collective already issued completes first
        handle.wait()
        assert torch.equal(out, expected)
        assert host_transport_of(group) is None
        threads.append(sum(t.name.startswith("mfsdp-shm-") for t in threading.enumerate()))
        out = torch.empty_like(expected)
        all_gather_into(
            shards[rank], out, group, transport=host_transport_of(group)
        ).wait()  # now through gloo
        assert torch.equal(out, expected)
    disable_host_transport(group)  # nothing to do, no error
    enable_host_transport(group, "shm", chunk_bytes=CHUNK)
    disable_host_transport()  # every group
    assert host_transport_of(group) is None
    return threads


def test_disabling_a_transport_stops_its_worker_and_returns_the_group_to_gloo() -> None:
    assert run_distributed(_disable_then_enable, 2, timeout=120) == [[0, 0], [0, 0]]


def _transport_of_another_group(rank: int, world: int) -> str:
    group = dist.new_group(list(range(world)))
    other = dist.new_group(list(range(world)))
    transport = enable_host_transport(group, "shm", chunk_bytes=CHUNK)
    out = torch.empty(2 * world)
    try:
        all_gather_into(torch.ones(2), out, other, transport=transport)
    except ValueError as exc:
        return str(exc)
    return "no error"


def test_a_transport_given_for_another_group_is_refused_before_any_collective() -> None:
    for message in run_distributed(_transport_of_another_group, 2, timeout=60):
        assert "not the collective's group" in message
        assert "enable_host_transport" in message


def _gather_passes_a_waiting_reduction(rank: int, world: int) -> list[Any]:
    """Rank 0 issues a reduce-scatter, then an all-gather; rank 1 issues the all-gather, waits
    for it, and only then its reduce-scatter. On one lane rank 0's reduce-scatter would meet
    rank 1's all-gather (wrong bytes, or a wait for a peer that waits for it); on two, each
    lane sees the same order on both ranks and rank 0's all-gather overtakes its reduction."""
    group = dist.new_group(list(range(world)))
    transport = enable_host_transport(group, "shm", chunk_bytes=CHUNK)
    assert transport is not None and transport.concurrent_reductions
    grads = torch.arange(2 * world * CHUNK // 4, dtype=torch.float32) * (rank + 1)
    shard = torch.empty(grads.numel() // world)
    gathered = torch.empty(4 * world)
    mine = torch.full((4,), float(rank))
    if rank == 0:
        reduced = reduce_scatter_into(grads, shard, group, transport=transport)
        all_gather_into(mine, gathered, group, transport=transport).wait()
        reduced.wait()
    else:
        all_gather_into(mine, gathered, group, transport=transport).wait()
        reduce_scatter_into(grads, shard, group, transport=transport).wait()
    names = sorted(t.name for t in threading.enumerate() if t.name.startswith("mfsdp-shm-"))
    return [gathered.tolist(), shard.tolist(), names]


def test_an_all_gather_overtakes_a_reduce_scatter_waiting_for_its_peer() -> None:
    results = run_distributed(_gather_passes_a_waiting_reduction, 2, timeout=60)
    n = 2 * 2 * CHUNK // 4
    mean = torch.arange(n, dtype=torch.float32) * 1.5
    for rank, (gathered, shard, names) in enumerate(results):
        assert gathered == [0.0] * 4 + [1.0] * 4
        assert shard == mean[rank * n // 2 : (rank + 1) * n // 2].tolist()
        assert any(name.endswith("-gather") for name in names), names
        assert any(name.endswith("-reduce") for name in names), names
