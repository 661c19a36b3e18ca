"""``plan_memory(..., optimizer_cpu_offload=True)`` (issue 54): the device's peak without what
host offload keeps on the host, and the host's bytes apart.

Planned for ``device="cuda"`` on this CPU-only torch, the CPU stands in for the accelerator
and the offload's copies are made as there (``fake_run.run_route``). Held to: the device's
peak and its bytes between steps drop by the main weights, gradients and optimizer state
against the same plan without offload; the host holds just those; and the host's bytes
between steps are what a real 2-rank run with the copies forced holds there.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from megatron_fsdp import fully_shard_model, fully_shard_optimizer
from megatron_fsdp.plan import MemoryPlan, plan_memory
from mfsdp_buffers import LiveTensorTracker
from mfsdp_collectives.testing import run_distributed
from mfsdp_hooks.testing.offload import forced_host_copies

MOVED = ("main_weights", "gradients", "optimizer_state")
PARAMS = 14
TOKENS = torch.randint(0, 37, (2, 5), generator=torch.Generator().manual_seed(0))


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(13, 290)
        self.down = nn.Linear(290, 13)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(x)))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(37, 13)
        self.blocks = nn.Sequential(Block(), Block(), Block())
        self.head = nn.Linear(13, 37)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(self.embed(tokens)))


def _loss(out: torch.Tensor) -> torch.Tensor:
    return out.float().sum()


def _plan(offload: bool) -> MemoryPlan:
    with torch.device("meta"):
        meta = Net()
    return plan_memory(
        meta,
        world_size=2,
        rank=0,
        example_inputs=(TOKENS,),
        loss_fn=_loss,
        fsdp_unit_modules=[Block],
        optimizer_cpu_offload=offload,
        device="cuda",
    )


def _forced_run(rank: int, world: int) -> dict[str, Any]:
    """Two AdamW steps of the real engine with the copies forced: what the host holds."""
    with LiveTensorTracker(device="cpu") as tracker:
        torch.manual_seed(0)
        with forced_host_copies():
            model = fully_shard_model(
                Net(), [Block], optimizer_cpu_offload=True, host_transport="gloo"
            )
        optimizer = fully_shard_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-3))
        for _ in range(2):
            _loss(model(TOKENS)).backward()
            optimizer.step()
            between = tracker.host_live
            optimizer.zero_grad()
        host = model.describe_sharding(optimizer).host_totals()
    return {"host_between": between, "host": {c: host[c] for c in MOVED}}


def test_the_plan_moves_main_weights_gradients_and_optimizer_state_to_the_host() -> None:
    plain, moved = _plan(offload=False), _plan(offload=True)
    states = plain.states.totals()
    # fp32 ZeRO-3: without offload the compute shard is what the optimizer steps.
    expected = {
        "main_weights": states["compute_weights"],
        "gradients": states["gradients"],
        "optimizer_state": states["optimizer_state"],
    }
    assert plain.host_states == {} and plain.host_peak_bytes == 0
    assert moved.host_states == expected
    moved_bytes = sum(expected.values())
    # All of it to the tracker too, but for AdamW's step counters (a float32 each): torch
    # makes them on the CPU from nothing, host tensors on an accelerator, indistinct here.
    counters = moved_bytes - moved.host_between_steps_bytes
    assert 0 <= counters <= 4 * PARAMS, counters
    assert moved.host_peak_bytes >= moved_bytes  # and the host step's temporaries
    device_states = moved.states.device_totals()
    assert all(device_states[c] == 0 for c in MOVED) and device_states["compute_weights"] == 0
    # Between steps the device holds none of it; at the peak it stages one unit's gradients.
    dropped = plain.between_steps_bytes - moved.between_steps_bytes
    # The device counts 512-byte blocks: up to a block more for each of the 16 storages
    # (4 groups' weights, gradients and AdamW's two moments).
    slack = 16 * 512
    assert moved_bytes <= dropped <= moved_bytes + slack, (dropped, moved_bytes)
    drop = plain.peak_bytes - moved.peak_bytes
    assert moved_bytes - states["gradients"] <= drop <= moved_bytes + slack, (drop, moved_bytes)
    assert "on the host" in str(moved)
    # A real run with the copies forced holds on the host what the plan says.
    real = run_distributed(_forced_run, 2, timeout=120)[0]
    assert real["host"] == expected
    assert real["host_between"] == moved.host_between_steps_bytes
