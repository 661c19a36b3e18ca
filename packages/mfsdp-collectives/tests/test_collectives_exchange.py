"""``all_to_all_into``: uneven pieces, nothing sent to oneself, and bad counts named."""

from __future__ import annotations

import torch
import torch.distributed as dist

from mfsdp_collectives import CommTracer, all_to_all_into
from mfsdp_collectives.testing import run_distributed


def _pieces(rank: int, world: int) -> tuple[list[float], int, int]:
    # Rank r sends rank q (q != r) r + q values of 10 * r + q; nothing to itself.
    counts = [0 if q == rank else rank + q for q in range(world)]
    send = torch.cat([torch.full((c,), float(10 * rank + q)) for q, c in enumerate(counts)])
    recv_counts = [0 if s == rank else s + rank for s in range(world)]
    recv = torch.empty(sum(recv_counts))
    group = dist.group.WORLD
    assert group is not None
    with CommTracer() as tracer:
        all_to_all_into(send, counts, recv, recv_counts, group)
    return recv.tolist(), tracer.calls("all_to_all"), tracer.bytes("all_to_all")


def test_each_rank_gets_its_piece_from_every_other() -> None:
    world = 3
    for rank, (received, calls, sent) in enumerate(run_distributed(_pieces, world)):
        expected = [
            float(10 * source + rank)
            for source in range(world)
            if source != rank
            for _ in range(source + rank)
        ]
        assert received == expected
        assert calls == 1
        assert sent == 4 * sum(rank + q for q in range(world) if q != rank)


def _bad_counts(rank: int, world: int) -> list[str]:
    group = dist.group.WORLD
    assert group is not None
    errors = []
    for send_counts, recv_counts in [([1], [1, 1]), ([2, 1], [1, 1]), ([-1, 3], [1, 1])]:
        try:
            all_to_all_into(torch.zeros(2), send_counts, torch.zeros(2), recv_counts, group)
        except ValueError as error:
            errors.append(str(error))
    return errors


def test_bad_counts_are_named_before_any_collective() -> None:
    errors = run_distributed(_bad_counts, 2)[0]
    assert "send_counts must give one count per rank of the group (2)" in errors[0]
    assert "send_counts adds up to 3 elements but send has 2" in errors[1]
    assert "send_counts must be non-negative" in errors[2]


def test_one_rank_exchanges_nothing() -> None:
    assert run_distributed(_one_rank, 1) == [0]


def _one_rank(rank: int, world: int) -> int:
    group = dist.group.WORLD
    assert group is not None
    with CommTracer() as tracer:
        all_to_all_into(torch.zeros(0), [0], torch.zeros(0), [0], group)
    return tracer.calls("all_to_all")
