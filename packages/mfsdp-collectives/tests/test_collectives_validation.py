"""Bad input raises a clear error naming the argument, before any collective.

Each rank runs every bad call and then one real collective: if a bad call had
issued anything, the ranks' collectives would be mismatched and the final
check would fail or hang (caught by the harness timeout).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist

from mfsdp_collectives import (
    CommStreams,
    ReduceSpec,
    all_gather_into,
    all_reduce_,
    all_to_all_into,
    broadcast_,
    hfsdp_reduce_scatter_into,
    hsdp_reduce_scatter_into,
    reduce_scatter_into,
)
from mfsdp_collectives.testing import run_distributed

# Typed as Any so the deliberately wrong arguments below need no type: ignore.
AG: Any = all_gather_into
RS: Any = reduce_scatter_into
HSDP: Any = hsdp_reduce_scatter_into
HFSDP: Any = hfsdp_reduce_scatter_into
A2A: Any = all_to_all_into
AR: Any = all_reduce_
BC: Any = broadcast_
SPEC: Any = ReduceSpec


def _cases(ws: int, rank: int) -> list[tuple[type[Exception], str, Callable[[], object]]]:
    """``(exception, message regex, bad call)``; ``ws`` ranks, shard of 2 elements."""
    g = dist.group.WORLD
    z = torch.zeros
    full, shard = 2 * ws, 2
    bf16, i64 = torch.bfloat16, torch.int64
    return [
        (TypeError, "shard must be a torch.Tensor", lambda: AG([1.0], z(full), g)),
        (ValueError, "shard must be a 1-D", lambda: AG(z(1, 2), z(full), g)),
        (ValueError, "unsharded must be contiguous", lambda: AG(z(2), z(2 * full)[::2], g)),
        (
            ValueError,
            rf"unsharded.numel\(\) == shard.numel\(\) \* {ws}",
            lambda: AG(z(2), z(full + 1), g),
        ),
        (ValueError, "shard has dtype", lambda: AG(z(shard, dtype=bf16), z(full), g)),
        (
            TypeError,
            "group must be a torch.distributed.ProcessGroup",
            lambda: AG(z(2), z(full), None),
        ),
        (ValueError, "not this rank's slot", lambda: _misaligned_alias(ws, rank)),
        (TypeError, "stream must be a CommStreams", lambda: AG(z(2), z(full), g, stream="s")),
        (ValueError, "unsharded_grad has 5 elements", lambda: RS(z(5), z(shard), g)),
        (
            TypeError,
            "reduce_dtype must be a torch.dtype",
            lambda: RS(z(full), z(shard), g, spec=SPEC(reduce_dtype="fp32")),
        ),
        (
            ValueError,
            "pre_scale must be finite",
            lambda: RS(z(full), z(shard), g, spec=SPEC(pre_scale=float("inf"))),
        ),
        (
            ValueError,
            "post_scale must be finite and non-zero",
            lambda: RS(z(full), z(shard), g, spec=SPEC(post_scale=0.0)),
        ),
        (
            TypeError,
            "post_scale must be a float",
            lambda: RS(z(full), z(shard), g, spec=SPEC(post_scale=True)),
        ),
        (
            TypeError,
            "average must be a bool",
            lambda: RS(z(full), z(shard), g, spec=SPEC(average=1)),
        ),
        (
            TypeError,
            "spec must be a mfsdp_collectives.ReduceSpec",
            lambda: RS(z(full), z(shard), g, spec=True),
        ),
        (TypeError, "floating-point", lambda: RS(z(full, dtype=i64), z(shard, dtype=i64), g)),
        (ValueError, "out_shard must be a 1-D", lambda: RS(z(full), z(1, shard), g)),
        (ValueError, "unsharded_grad has 5 elements", lambda: HSDP(z(5), z(shard), g, None)),
        (TypeError, "outer_group must be", lambda: HSDP(z(full), z(shard), g, "outer")),
        (ValueError, "outer_group must differ", lambda: HSDP(z(full), z(shard), g, g)),
        (
            ValueError,
            "outer_group must differ from shard_group; use reduce_scatter_into",
            lambda: HFSDP(z(full), z(1), g, g, partial=z(shard)),
        ),
        (ValueError, "tensor must be contiguous", lambda: AR(z(4, 4).t(), g)),
        (TypeError, "tensor must be a torch.Tensor", lambda: AR(3.0, g)),
        (ValueError, "outer_group must differ from group", lambda: AR(z(4), g, outer_group=g)),
        (TypeError, "tensor must be a torch.Tensor", lambda: BC(3.0, 0, g)),
        (ValueError, "tensor must be contiguous; broadcast", lambda: BC(z(4, 4).t(), 0, g)),
        (
            ValueError,
            "send has dtype torch.float32 but recv has torch.bfloat16",
            lambda: A2A(z(full), [2] * ws, z(full, dtype=bf16), [2] * ws, g),
        ),
        (ValueError, "src_rank_in_group=5", lambda: BC(z(2), 5, g)),
        (ValueError, r"src_rank_in_group=-1 must be an int in \[0, ", lambda: BC(z(2), -1, g)),
    ]


def _misaligned_alias(ws: int, rank: int) -> object:
    buf = torch.zeros(2 * ws)
    wrong = (rank + 1) % ws
    return AG(buf[wrong * 2 : wrong * 2 + 2], buf, dist.group.WORLD)


def _validation_world(rank: int, ws: int) -> int:
    cases = _cases(ws, rank)
    for exc, match, call in cases:
        with pytest.raises(exc, match=match):
            call()
    # nothing was issued: the first real collective still lines up on every rank
    t = torch.tensor([float(rank)])
    dist.all_reduce(t)
    assert t.item() == sum(range(ws))
    # inert CPU streams are accepted; zero-sized buffers complete without communicating
    empty = AG(torch.zeros(0), torch.zeros(0), dist.group.WORLD, stream=CommStreams("cpu"))
    assert empty.is_completed()
    return len(cases)


def test_bad_input_raises_before_any_collective() -> None:
    counts = run_distributed(_validation_world, 2, timeout=60)
    assert counts[0] == counts[1] > 20


def test_comm_streams_are_inert_on_cpu() -> None:
    streams = CommStreams("cpu")
    assert not streams.active and streams.all_gather is None
    assert CommStreams("cpu", enabled=False).reduce_scatter is None
    with pytest.raises(TypeError, match="device"):
        CommStreams(3)  # type: ignore[arg-type]
