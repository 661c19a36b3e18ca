"""``describe_sharding()`` under host offload (issue 54): what moved to the host.

At 2 ranks with the copies forced (the CPU standing in for the device), the summary says,
category by category, that the main weights, the reduced gradients and AdamW's state are
on the host and nothing else: the compute weights and the gathered weights stay on the
device. The bytes are checked against the run without offload: the host holds what that run
held of those three on the device, and the same tracker, counting the host apart, sees the
host bytes the summary names.
"""

from __future__ import annotations

from typing import Any

import torch
from hooks_models import residual_model
from torch.distributed.fsdp import CPUOffloadPolicy

from mfsdp_buffers import LiveTensorTracker
from mfsdp_collectives.testing import run_distributed
from mfsdp_hooks import ShardingSummary, fully_shard
from mfsdp_hooks.testing.offload import forced_host_copies

MOVED = ("main_weights", "gradients", "optimizer_state")


def _described(offload: bool) -> tuple[ShardingSummary, str, int]:
    """The summary after one step, its table, and the host bytes a tracker counted then."""
    with LiveTensorTracker(device="cpu") as tracker:
        model = residual_model()
        policy = CPUOffloadPolicy(pin_memory=False) if offload else None
        with forced_host_copies():
            for module in (model[1], model[2], model):
                fully_shard(module, offload_policy=policy)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        model(torch.randn(3, 8)).sum().backward()
        optimizer.step()
        summary = model.describe_sharding(optimizer)  # type: ignore[operator]
        return summary, str(summary), tracker.host_live


def _worker(rank: int, world: int) -> dict[str, Any]:
    plain, _, plain_host = _described(offload=False)
    moved, table, host_live = _described(offload=True)
    return {
        "plain": (plain.totals(), plain.host_totals(), plain_host),
        "moved": (moved.totals(), moved.host_totals(), moved.device_totals()),
        "host_live": host_live,
        "host_between_steps": moved.host_between_steps_bytes,
        "table": table,
    }


def test_describe_says_what_offload_keeps_on_the_host() -> None:
    for got in run_distributed(_worker, 2, timeout=120):
        plain_totals, plain_host, plain_host_live = got["plain"]
        totals, host, device = got["moved"]
        assert not any(plain_host.values()) and plain_host_live == 0  # nothing offloaded
        for category in MOVED:
            assert host[category] > 0 and device[category] == 0, category
        assert host["compute_weights"] == host["gathered_weights"] == 0
        assert device["gathered_weights"] == totals["gathered_weights"] > 0
        # fp32: without offload the compute shard is what the optimizer steps; with it,
        # the host's main shard is (no compute shard persists under ZeRO-3).
        assert host["main_weights"] == plain_totals["compute_weights"]
        assert device["compute_weights"] == 0
        assert host["gradients"] == plain_totals["gradients"]
        assert host["optimizer_state"] == plain_totals["optimizer_state"]
        assert got["host_between_steps"] == sum(host[c] for c in MOVED)
        # The tracker agrees, but for AdamW's step counters: torch makes them on the CPU from
        # nothing (on an accelerator, host tensors; where the CPU stands in, indistinct).
        counters = 4 * 12  # a float32 per parameter of the model
        assert got["host_live"] == got["host_between_steps"] - counters
        assert " host" in got["table"] and "of it on the host" in got["table"]
