"""Custom comms (FSDP2's ``Comm`` protocol) and ``ReduceSpec.sum_only`` on the collectives:
the comm runs the collective in a buffer it allocated, the result lands where the built-in
path puts it, ``after_reduce`` sees the reduced chunk before it is stored, a bad comm or a bad
buffer raises naming itself, and ``sum_only`` turns the transport's average into a sum and a
divide without changing the result (2 gloo ranks, c10d and the shared-memory transport)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist

from mfsdp_collectives import (
    ReduceSpec,
    all_gather_into,
    check_comm,
    enable_host_transport,
    reduce_scatter_into,
)
from mfsdp_collectives.testing import run_distributed
from mfsdp_collectives.testing.counting_comms import CountingAllGather, CountingReduceScatter


class _WrongSize(CountingAllGather):
    def allocate(self, size: Any, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(3, dtype=dtype, device=device)


def _comms_world(rank: int, world: int) -> dict[str, Any]:
    group = dist.group.WORLD
    assert group is not None
    out: dict[str, Any] = {}
    gather = CountingAllGather()
    full = torch.empty(4 * world)
    all_gather_into(full[4 * rank : 4 * rank + 4].fill_(rank + 1), full, group, comm=gather).wait()
    out["gathered"] = full.tolist()
    out["gather"] = (gather.calls, gather.allocated)
    scatter, seen = CountingReduceScatter(), []
    grad = torch.arange(6 * world, dtype=torch.float32) * (rank + 1)
    shard = torch.zeros(6)
    reduce_scatter_into(grad, shard, group, comm=scatter, after_reduce=seen.append).wait()
    out["shard"] = shard.tolist()
    out["scatter"] = (scatter.calls, scatter.allocated, scatter.ops)
    out["seen"] = [t.tolist() for t in seen]
    with pytest.raises(RuntimeError) as caught:
        all_gather_into(torch.ones(4), full, group, comm=_WrongSize()).wait()
    out["wrong_size"] = str(caught.value)
    with pytest.raises(TypeError) as typed:
        check_comm(object(), "comm")
    out["not_a_comm"] = str(typed.value)
    return out


def test_custom_comms_run_the_collectives_into_their_own_buffers() -> None:
    results = run_distributed(_comms_world, 2, timeout=60)
    for rank, out in enumerate(results):
        assert out["gathered"] == [1.0] * 4 + [2.0] * 4
        assert out["gather"] == (1, [(8,)])
        mean = (torch.arange(12, dtype=torch.float32) * 1.5)[6 * rank : 6 * rank + 6]
        assert out["shard"] == mean.tolist()
        calls, allocated, ops = out["scatter"]
        assert calls == 1 and allocated == [(6,)]
        assert len(out["seen"]) == 1  # the hook saw the chunk before any divide still owed
        owed = 1.0 if ops == [str(dist.ReduceOp.AVG)] else 2.0
        assert out["seen"][0] == (mean * owed).tolist()
        assert "returned shape (3,)" in out["wrong_size"]
        assert "FSDP2's protocol" in out["not_a_comm"]


def _sum_only_world(rank: int, world: int) -> list[Any]:
    group = dist.group.WORLD
    assert group is not None
    transport = enable_host_transport(group, "shm")
    asked: list[bool] = []
    carry = transport.reduce_scatter

    def spy(recv: torch.Tensor, send: Any, *, average: bool) -> Any:
        asked.append(average)
        return carry(recv, send, average=average)

    transport.reduce_scatter = spy  # type: ignore[method-assign]
    results = []
    for sum_only in (False, True):
        grad = torch.arange(4 * world, dtype=torch.float32) + rank
        shard = torch.zeros(4)
        spec = ReduceSpec(sum_only=sum_only)
        reduce_scatter_into(grad, shard, group, spec=spec, transport=transport).wait()
        results.append(shard.tolist())
    return [asked, results]


def test_sum_only_sums_on_the_wire_and_divides_the_output() -> None:
    for rank, (asked, (averaged, summed)) in enumerate(run_distributed(_sum_only_world, 2)):
        assert asked == [True, False]
        expected = (torch.arange(8, dtype=torch.float32) + 0.5)[4 * rank : 4 * rank + 4]
        assert averaged == summed == expected.tolist()


class _RecordsOutputs:
    """Mixed in before a counting comm: it takes the caller's buffers and remembers where
    each call wrote."""

    uses_caller_buffers = True

    def __init__(self) -> None:
        super().__init__()
        self.outputs: list[int] = []

    def __call__(self, output_tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        self.outputs.append(output_tensor.data_ptr())
        return super().__call__(output_tensor, *args, **kwargs)  # type: ignore[misc]


class _GatherIntoCallers(_RecordsOutputs, CountingAllGather):
    pass


class _ScatterIntoCallers(_RecordsOutputs, CountingReduceScatter):
    pass


def _caller_buffers_world(rank: int, world: int) -> dict[str, Any]:
    group = dist.group.WORLD
    assert group is not None
    gather, scatter = _GatherIntoCallers(), _ScatterIntoCallers()
    full = torch.full((4 * world,), -1.0)
    shard = torch.full((4,), float(rank + 1))
    all_gather_into(shard, full, group, comm=gather).wait()
    grad = torch.arange(6 * world, dtype=torch.float32) * (rank + 1)
    stored, added = torch.zeros(6), torch.ones(6)
    reduce_scatter_into(grad, stored, group, comm=scatter).wait()
    reduce_scatter_into(grad, added, group, comm=scatter, accumulate=True).wait()
    return {
        "gathered": full.tolist(),
        "gather_wrote_into_full": gather.outputs == [full.data_ptr()],
        "gather_allocated": gather.allocated,
        "stored": stored.tolist(),
        "added": added.tolist(),
        "scatter_wrote_into_stored": scatter.outputs[0] == stored.data_ptr(),
        "scatter_allocated": scatter.allocated,
    }


def test_a_comm_that_uses_caller_buffers_writes_into_them_without_a_copy() -> None:
    for rank, out in enumerate(run_distributed(_caller_buffers_world, 2, timeout=60)):
        assert out["gathered"] == [1.0] * 4 + [2.0] * 4
        assert out["gather_wrote_into_full"] and out["gather_allocated"] == []
        mean = (torch.arange(12, dtype=torch.float32) * 1.5)[6 * rank : 6 * rank + 6]
        assert out["stored"] == mean.tolist()
        assert out["added"] == (mean + 1).tolist()
        # storing reduces straight into the shard; adding needs a buffer for the sum first
        assert out["scatter_wrote_into_stored"] and out["scatter_allocated"] == [(6,)]
