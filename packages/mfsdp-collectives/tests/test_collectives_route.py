"""``Route``: the public ops' collectives, their group and transport checked once.

Its ops issue what the public ops issue (the same results, collectives and bytes), and its
constructor refuses what the public ops refuse about a group, naming the argument.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.distributed as dist

from mfsdp_collectives import (
    CommHandle,
    CommTracer,
    ReduceSpec,
    Route,
    SharedMemoryTransport,
    all_gather_into,
    all_reduce_,
    enable_host_transport,
    hfsdp_reduce_scatter_into,
    hsdp_reduce_scatter_into,
    reduce_scatter_into,
)
from mfsdp_collectives.testing import run_distributed

_SPEC = ReduceSpec(post_scale=0.5)

Issue = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], CommHandle]


def _ops(
    shard: dist.ProcessGroup,
    outer: dist.ProcessGroup,
    transport: SharedMemoryTransport | None,
) -> dict[str, tuple[Issue, Issue]]:
    """Each op as (the public call, the route's call), on (input, output, partial)."""
    route, across = Route(shard, transport), Route(outer)
    return {
        "all_gather": (
            lambda x, out, _: all_gather_into(x[:4], out, shard, transport=transport),
            lambda x, out, _: route.all_gather_into(x[:4], out),
        ),
        "reduce_scatter": (
            lambda x, out, _: reduce_scatter_into(
                x, out[:4], shard, spec=_SPEC, transport=transport, accumulate=True
            ),
            lambda x, out, _: route.reduce_scatter_into(x, out[:4], spec=_SPEC, accumulate=True),
        ),
        "all_reduce": (
            lambda x, out, _: all_reduce_(out, shard, spec=_SPEC, outer_group=outer),
            lambda x, out, _: route.all_reduce_(out, spec=_SPEC, outer=across),
        ),
        "hsdp": (
            lambda x, out, _: hsdp_reduce_scatter_into(
                x, out[:4], shard, outer, spec=_SPEC, transport=transport
            ),
            lambda x, out, _: route.hsdp_reduce_scatter_into(x, out[:4], across, spec=_SPEC),
        ),
        "hfsdp": (
            lambda x, out, part: hfsdp_reduce_scatter_into(
                x, out[:4], shard, outer, partial=part, spec=_SPEC, transport=transport
            ),
            lambda x, out, part: route.hfsdp_reduce_scatter_into(
                x, out[:4], across, partial=part, spec=_SPEC
            ),
        ),
    }


def _same_as_public_worker(rank: int, world: int) -> None:
    shard = dist.new_group(list(range(world)))
    outer = [dist.new_group([r]) for r in range(world)][rank]  # a replica of one rank
    transport = enable_host_transport(shard, "shm")
    assert transport is not None
    for name, (public, routed) in _ops(shard, outer, transport).items():
        results = []
        for issue in (public, routed):
            x = torch.arange(8.0) * (rank + 1)
            out, partial = torch.ones(8), torch.zeros(4)
            with CommTracer() as tracer:
                issue(x, out, partial).wait()
            traffic = [(r.op, r.group, r.numel, r.dtype) for r in tracer.records]
            results.append((out, partial, traffic))
        (out, partial, traffic), (r_out, r_partial, r_traffic) = results
        assert traffic == r_traffic and traffic, (name, traffic, r_traffic)
        torch.testing.assert_close(r_out, out, msg=name)
        torch.testing.assert_close(r_partial, partial, msg=name)


def test_route_ops_issue_what_the_public_ops_issue() -> None:
    run_distributed(_same_as_public_worker, 2, timeout=60)


def _refusals_worker(rank: int, world: int) -> list[str]:
    group = dist.new_group(list(range(world)))
    other = dist.new_group(list(range(world)))
    transport = enable_host_transport(group, "shm")
    messages = []
    for args in ((other, transport), ("world", None)):
        with pytest.raises((ValueError, TypeError)) as error:
            Route(*args)
        messages.append(str(error.value))
    return messages


def test_a_route_refuses_what_the_public_ops_refuse() -> None:
    for wrong_transport, not_group in run_distributed(_refusals_worker, 2, timeout=60):
        assert "not the collective's group" in wrong_transport
        assert "enable_host_transport" in wrong_transport
        assert "group must be a torch.distributed.ProcessGroup" in not_group
