"""The engine's collectives are checked once, where it lays its buffers out, not per step.

The public ops of ``mfsdp_collectives`` check every argument on every call (a user calling
them gets an error naming the argument); the engine's gathers and reductions go through
``Route``s built at wrap time, so a training step runs none of those checks and asks no
process group for this rank's place in it. What a user still controls per step (a
gradient allocator of theirs) is checked where it is used.
"""

from __future__ import annotations

import sys
from collections import Counter
from collections.abc import Hashable
from pathlib import Path
from types import FrameType

import pytest
import torch
import torch.distributed as dist

import mfsdp_collectives
from mfsdp_collectives.testing import run_distributed
from mfsdp_hooks import fully_shard
from mfsdp_hooks.testing import loss_fn, make_batches, make_model

_PACKAGE = Path(mfsdp_collectives.__file__).parent
# The argument checks of the public ops (their files, then their names).
_CHECK_FILES = (str(_PACKAGE / "core" / "_checks.py"), str(_PACKAGE / "issuing" / "_op_args.py"))
_CHECKS = {
    "check_flat",
    "check_same_device",
    "check_shard_sizes",
    "check_reduce_scatter",
    "check_pieces",
    "membership",
    "reduce_spec",
    "side_stream",
}
_GET_RANK = dist.get_rank.__code__


def _checks_in_one_step(rank: int, world: int) -> dict[str, int]:
    model = make_model()
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    tokens, targets = make_batches(1, 4)[0]
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)

    def step() -> None:
        loss_fn(model(tokens), targets).backward()
        optimizer.step()
        optimizer.zero_grad()

    step()  # the first step records the order and builds what is built lazily
    counts: Counter[str] = Counter()

    def profile(frame: FrameType, event: str, arg: object) -> None:
        if event != "call":
            return
        code = frame.f_code
        if code is _GET_RANK:
            counts["dist.get_rank"] += 1
        elif code.co_name in _CHECKS and code.co_filename in _CHECK_FILES:
            counts[code.co_name] += 1

    sys.setprofile(profile)
    try:
        step()
    finally:
        sys.setprofile(None)
    return dict(counts)


def test_a_training_step_runs_no_per_op_checks() -> None:
    # 4 units (3 blocks and the root): 8 all-gathers and 4 reduce-scatters a step. Before the
    # routes, each ran its checks: 13 memberships (one dist.get_rank each), 20 check_flat, ...
    # What is left is the one all-reduce that agrees on which gradients exist (once per
    # backward, for every unit together): a public call, checked as one.
    for counts in run_distributed(_checks_in_one_step, 2, timeout=60):
        assert counts == {"membership": 1, "reduce_spec": 1, "side_stream": 1}, counts


class _ShortBuffers:
    """A gradient allocator of the user's that hands out one element too few."""

    def allocate(
        self, key: Hashable, numel: int, dtype: torch.dtype, device: torch.device
    ) -> torch.Tensor:
        return torch.empty(numel - 1, dtype=dtype, device=device)

    def free(self, key: Hashable, tensor: torch.Tensor) -> None:
        pass


def _short_grad_buffer(rank: int, world: int) -> str:
    model = make_model()
    fully_shard(model, grad_buffer_allocator=_ShortBuffers())
    tokens, targets = make_batches(1, 4)[0]
    with pytest.raises(RuntimeError) as error:
        loss_fn(model(tokens), targets).backward()
    return str(error.value)


def test_a_users_gradient_allocator_is_checked_where_it_is_used() -> None:
    # The reduce-scatter no longer checks its input each step: the allocator's buffer is
    # checked as it comes back, before any collective reads it.
    for message in run_distributed(_short_grad_buffer, 2, timeout=60):
        assert "_ShortBuffers returned shape" in message, message
        assert "expected (" in message
