"""The wrap-time agreement check costs one small fixed-size all-gather per call once a group's
processes are known, whatever the facts weigh and however many ranks there are; ranks that
disagree still get every fact that differs, named per rank; and the processes learned by the
first call of a group are what the survivors name when a peer dies later."""

from __future__ import annotations

import os
import signal
import time

import torch
import torch.distributed as dist

from mfsdp_collectives import (
    C10dTracer,
    PeerDiedError,
    RankMismatchError,
    check_ranks_agree,
    naming_dead_peers,
)
from mfsdp_collectives.testing import run_distributed, run_distributed_outcomes

Calls = list[tuple[str, int, torch.dtype]]

WHAT = "fully_shard(Block)"
FACTS = {"module": "Block", "parameters": "2 parameters, 6 elements"}
HEAVY = {"module": "Block", "parameters": "x" * 100_000}  # a big fact: the exchange is no bigger


def _traced(group: dist.ProcessGroup, facts: dict[str, str]) -> Calls:
    with C10dTracer() as log:
        check_ranks_agree(group, facts, what=WHAT)
    return [(r.op, r.numel, r.dtype) for r in log.records]


def _mismatch(group: dist.ProcessGroup, rank: int) -> str:
    try:
        check_ranks_agree(
            group,
            {"module": "Block", "parameters": f"{2 + rank} parameters"},
            what=WHAT,
            details={"parameters": ["a (2,)", f"b ({2 + rank},)"]},
        )
    except RankMismatchError as error:
        return str(error)
    return "the ranks agreed although their facts differ"


def _agreeing(rank: int, world: int) -> tuple[list[Calls], list[str]]:
    group = dist.new_group(list(range(world)))
    calls = [_traced(group, FACTS), _traced(group, FACTS), _traced(group, HEAVY)]
    other = dist.new_group(list(range(world)))
    messages = [_mismatch(other, rank)]  # a new group's first call: the facts themselves
    calls.append(_traced(other, FACTS))
    return calls, [*messages, _mismatch(group, rank)]  # the digests differ first


def test_agreeing_ranks_exchange_one_fixed_size_digest_after_the_first_call() -> None:
    for calls, messages in run_distributed(_agreeing, 2, timeout=60):
        first, second, heavy, after_a_mismatch = calls
        assert len(second) == 1, second  # no all_gather_object (two all-gathers of its own)
        op, numel, dtype = second[0]
        assert (op, dtype) == ("all_gather", torch.uint8) and numel <= 64, second
        assert heavy == second, heavy  # 100 kB of facts, the same few bytes
        assert len(first) > 1, first  # a group's first call learns its processes (objects)
        assert after_a_mismatch == second, after_a_mismatch  # which learnt them too
        # Whether the digests or the first call found it, every differing fact is named.
        assert messages == 2 * [
            f"{WHAT}: the ranks of group pg[0,1] disagree on\n"
            "  parameters: rank 0: 2 parameters; rank 1: 3 parameters\n"
            "    first difference in parameters, item 1: rank 0: b (2,); rank 1: b (3,)\n"
            "rank 1 differs from rank 0 (as many ranks on each side: either may be the one to "
            "fix)\nEvery rank must build the same model and call the same wrapping functions "
            "with the same arguments in the same order; fix the rank(s) that differ"
        ], messages


def _agree_then_lose_a_peer(rank: int, world: int) -> str:
    group = dist.new_group(list(range(world)))
    check_ranks_agree(group, FACTS, what=WHAT)  # learns the peers' processes, once
    check_ranks_agree(group, FACTS, what=WHAT)
    if rank == 1:
        time.sleep(0.3)  # rank 0 is waiting inside the all-reduce by now
        os.kill(os.getpid(), signal.SIGKILL)
    with naming_dead_peers("the all-reduce", group):
        dist.all_reduce(torch.ones(4), group=group)
    return "the all-reduce finished although a peer died"


def test_the_processes_the_first_call_learnt_name_a_dead_peer() -> None:
    death, survivor = run_distributed_outcomes(_agree_then_lose_a_peer, 2, timeout=60)[::-1]
    assert death.died, death
    assert survivor.error is not None, survivor.result
    error = survivor.error.exception
    assert isinstance(error, PeerDiedError) and error.ranks == [1], survivor.error
    assert "rank 1 (pid" in str(error), error
