"""The stream simulator: collectives on simulated side streams, ordering bugs raise."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from mfsdp_collectives import CommStreams, ReduceSpec, all_gather_into, reduce_scatter_into
from mfsdp_collectives.testing import run_distributed
from mfsdp_collectives.testing.stream_sim import StreamOrderError, simulated_streams


def test_clocks_follow_wait_stream_events_and_host_synchronisation() -> None:
    with simulated_streams() as sim:
        streams = CommStreams("cpu")
        assert streams.active and streams.all_gather is not None
        side, compute = streams.all_gather, sim.compute
        x = torch.ones(4)  # written on compute
        with pytest.raises(StreamOrderError, match="'all_gather' reads a buffer"), side:
            x.sum()
        side.wait_stream(compute)  # type: ignore[arg-type]
        with side:
            y = x * 2  # allowed now; y is new memory written on the side stream
        event = side.record_event()
        assert not event.query(), "a poll never sees completion: code must not rely on it"
        with pytest.raises(StreamOrderError, match="'compute' reads a buffer"):
            y.sum()
        compute.wait_event(event)  # type: ignore[arg-type]
        y.sum()
        with side:
            z = y + 1
        side.synchronize()  # the host waited: everything after is ordered after it
        z.sum()
    assert not CommStreams("cpu").active, "outside the block CPU has no streams again"


def _collective(rank: int, world: int, bug: str) -> list[object]:
    group = dist.group.WORLD
    assert group is not None
    with simulated_streams() as sim:
        streams = CommStreams("cpu")
        shard = torch.full((4,), float(rank))
        full = torch.empty(4 * world)
        grads = torch.arange(8.0 * world)
        reduced = torch.zeros(8)
        if bug == "no_wait_stream":  # the seeds' PR 003
            streams.all_gather.wait_stream = lambda other: None  # type: ignore[method-assign,union-attr]
        shard.add_(1.0)  # compute writes the input right before the gather
        try:
            gather = all_gather_into(shard, full, group, stream=streams)
            scatter = reduce_scatter_into(
                grads, reduced, group, spec=ReduceSpec(average=False), stream=streams
            )
            if bug == "read_before_wait":
                full.sum()
            if bug == "reuse_input":
                grads.zero_()
            gather.wait()
            scatter.wait()
            return [full.tolist(), reduced.tolist(), sim.checked > 0]
        except StreamOrderError as exc:
            return [str(exc)]


def test_collectives_on_simulated_streams_give_the_right_result() -> None:
    for rank, (full, reduced, checked) in enumerate(
        run_distributed(_collective, 2, "", timeout=60)
    ):
        assert full == [1.0] * 4 + [2.0] * 4
        assert reduced == [2.0 * v for v in range(rank * 8, rank * 8 + 8)]
        assert checked


@pytest.mark.parametrize(
    ("bug", "says"),
    [
        ("no_wait_stream", "stream 'all_gather' reads a buffer ((4,)"),
        ("read_before_wait", "stream 'compute' reads a buffer ((8,)"),
        ("reuse_input", "stream 'compute' writes a buffer ((16,)"),
    ],
)
def test_ordering_bugs_raise_naming_the_streams(bug: str, says: str) -> None:
    for result in run_distributed(_collective, 2, bug, timeout=60):
        assert says in str(result[0]), result
