"""``coalesced_gathers()``: several all-gathers as one collective, with the same results.

Every gather of a block is checked against every rank's shards laid out as a plain
all-gather lays them, on the shared-memory transport (a 4 KiB chunk, so one exchange
carries pieces of several shards and shards span several exchanges) and on gloo (packed),
at 2 and 3 ranks with sizes that share no factor. The tracer counts one all-gather per group
and dtype, with the sum of the elements.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from mfsdp_collectives import (
    CommTracer,
    all_gather_into,
    coalesced_gathers,
    enable_host_transport,
)
from mfsdp_collectives.testing import run_distributed

CHUNK = 4096
SIZES = (1, 7, 1000, 3 * CHUNK + 17, 33)


def _shard(rank: int, index: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1000 * index + rank)
    return torch.randn(numel, generator=gen).to(dtype)


def _expected(world: int, index: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.cat([_shard(r, index, numel, dtype) for r in range(world)])


def _coalesced_worker(rank: int, world: int, transport_name: str) -> dict[str, object]:
    group = dist.new_group(list(range(world)))
    transport = enable_host_transport(group, transport_name, chunk_bytes=CHUNK)
    assert (transport is None) == (transport_name == "gloo")
    dtypes = [torch.float32, torch.bfloat16, torch.float32, torch.float32, torch.bfloat16]
    outputs, handles = [], []
    with CommTracer() as tracer, coalesced_gathers():
        for index, (numel, dtype) in enumerate(zip(SIZES, dtypes, strict=True)):
            out = torch.full((numel * world,), float("nan"), dtype=dtype)
            if index == 2:  # in place: the shard is this rank's slot of the output
                out[rank * numel : (rank + 1) * numel] = _shard(rank, index, numel, dtype)
                shard = out[rank * numel : (rank + 1) * numel]
            else:
                shard = _shard(rank, index, numel, dtype)
            handles.append(all_gather_into(shard, out, group, transport=transport))
            outputs.append(out)
        queued = len(tracer.records)  # nothing goes out before the block ends
    for handle in handles:
        handle.wait()
    for index, (numel, dtype, out) in enumerate(zip(SIZES, dtypes, outputs, strict=True)):
        assert torch.equal(out, _expected(world, index, numel, dtype)), index
    by_dtype = sorted((str(r.dtype), r.numel) for r in tracer.records)
    return {"queued": queued, "records": by_dtype}


@pytest.mark.parametrize(("world", "transport"), [(2, "shm"), (3, "shm"), (2, "gloo"), (3, "gloo")])
def test_coalesced_gathers_fill_every_output_in_one_collective_per_dtype(
    world: int, transport: str
) -> None:
    for result in run_distributed(_coalesced_worker, world, transport, timeout=120):
        assert result["queued"] == 0
        # float32: shards 0, 2, 3; bfloat16: shards 1, 4, each one collective.
        assert result["records"] == [
            ("torch.bfloat16", SIZES[1] + SIZES[4]),
            ("torch.float32", SIZES[0] + SIZES[2] + SIZES[3]),
        ], result


def _wait_inside_worker(rank: int, world: int) -> list[int]:
    """A wait inside the block issues its queue; later gathers start a new one."""
    group = dist.new_group(list(range(world)))
    transport = enable_host_transport(group, "shm", chunk_bytes=CHUNK)
    outs = [torch.empty(n * world) for n in (5, 6, 7)]
    with CommTracer() as tracer, coalesced_gathers():
        first = all_gather_into(
            _shard(rank, 0, 5, torch.float32), outs[0], group, transport=transport
        )
        second = all_gather_into(
            _shard(rank, 1, 6, torch.float32), outs[1], group, transport=transport
        )
        first.wait()  # issues the queue of the first two
        third = all_gather_into(
            _shard(rank, 2, 7, torch.float32), outs[2], group, transport=transport
        )
    second.wait()
    third.wait()
    for index, n in enumerate((5, 6, 7)):
        assert torch.equal(outs[index], _expected(world, index, n, torch.float32))
    return [r.numel for r in tracer.records]


def test_waiting_inside_the_block_issues_what_was_queued_so_far() -> None:
    for numels in run_distributed(_wait_inside_worker, 2, timeout=120):
        assert numels == [11, 7]


def _raising_worker(rank: int, world: int) -> bool:
    """A block that raises issues nothing at its end; a wait issues the queue later."""
    group = dist.new_group(list(range(world)))
    out = torch.empty(4 * world)
    handle = None
    with pytest.raises(RuntimeError, match="user code"), coalesced_gathers():
        handle = all_gather_into(torch.full((4,), float(rank)), out, group)
        raise RuntimeError("user code")
    assert handle is not None
    handle.wait()
    return torch.equal(out, torch.arange(world).repeat_interleave(4).float())


def test_a_block_that_raises_leaves_its_gathers_to_their_waits() -> None:
    assert all(run_distributed(_raising_worker, 2, timeout=120))
