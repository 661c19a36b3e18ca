"""Side-stream paths on a CUDA device with NCCL (skipped without one)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from mfsdp_collectives import (
    CommStreams,
    FSDPTopology,
    ReduceSpec,
    all_gather_into,
    all_reduce_,
    hsdp_reduce_scatter_into,
    reduce_scatter_into,
)
from mfsdp_collectives.testing import run_distributed

pytestmark = pytest.mark.cuda


def _cuda_world(rank: int, ws: int) -> bool:
    topo = FSDPTopology.default()
    device = topo.device
    assert device.type == "cuda"
    streams = CommStreams(device)
    assert streams.active and streams.all_gather is not None
    group = topo.shard_group
    n = 1 << 16
    # work queued on the compute stream before the op must be seen by it
    shard = torch.empty(n, device=device)
    shard.fill_(float(rank))
    full = torch.empty(n * ws, device=device)
    h = all_gather_into(shard, full, group, stream=streams)
    h.wait()
    expected = torch.arange(ws, device=device, dtype=torch.float32).repeat_interleave(n)
    assert torch.equal(full, expected)
    grads = torch.ones(n * ws, device=device, dtype=torch.bfloat16) * (rank + 1)
    out = torch.zeros(n, device=device, dtype=torch.bfloat16)
    h = reduce_scatter_into(
        grads, out, group, spec=ReduceSpec(reduce_dtype=torch.float32), stream=streams
    )
    h.wait()
    mean = sum(range(1, ws + 1)) / ws
    assert torch.allclose(out.float(), torch.full_like(out.float(), mean))
    out32 = torch.zeros(n, device=device)
    hsdp_reduce_scatter_into(grads, out32, group, None, stream=streams, accumulate=True).wait()
    assert torch.allclose(out32, torch.full_like(out32, mean))
    t = torch.full((n,), float(rank), device=device)
    all_reduce_(t, group, spec=ReduceSpec(average=False), stream=streams).wait()
    assert torch.allclose(t, torch.full_like(t, float(sum(range(ws)))))
    torch.accelerator.synchronize()
    return True


def test_side_streams_on_cuda() -> None:
    if not torch.cuda.is_available() or not dist.is_nccl_available():
        pytest.skip("needs a CUDA device and NCCL: side streams only exist on accelerators")
    ws = min(2, torch.cuda.device_count())
    assert run_distributed(_cuda_world, ws, backend="nccl", timeout=120) == [True] * ws
