"""Fault injection through the whole stack: a rank SIGKILLed in forward, backward, the
optimizer step or a checkpoint save makes every survivor raise ``PeerDiedError`` naming it
within seconds, on the shared-memory and the gloo transport; under torchrun the job exits
non-zero.

The victim kills itself from a hook the test registers on its own model, optimizer or
checkpoint writer, at the second training step (the first one has recorded the execution
order, so prefetching is on, as in a real job).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.distributed.checkpoint.filesystem import FileSystemWriter

import mfsdp_checkpoint as mc
from megatron_fsdp import fully_shard_model, fully_shard_optimizer
from mfsdp_collectives import PeerDiedError
from mfsdp_collectives.testing import run_distributed_outcomes
from mfsdp_hooks.testing import Block, local_slice, loss_fn, make_batches, make_model

RAISE_WITHIN_S = 5.0
VICTIM = 1
FAULT_STEP = 1


def _die(*_: Any, **__: Any) -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def _arm(point: str, model: torch.nn.Module, optimizer: torch.optim.Optimizer, path: str) -> None:
    """Make this rank die at ``point`` of the next step."""
    if point == "forward":
        model.module.blocks[1].register_forward_pre_hook(_die)
    elif point == "backward":
        model.module.blocks[1].register_full_backward_hook(_die)
    elif point == "optimizer_step":
        optimizer.register_step_pre_hook(_die)
    elif point == "save_checkpoint":
        original = FileSystemWriter.write_data

        def write_then_die(self: Any, plan: Any, planner: Any) -> Any:
            original(self, plan, planner).wait()
            _die()

        FileSystemWriter.write_data = write_then_die  # type: ignore[method-assign]
    else:
        raise ValueError(point)


def _train_until_killed(rank: int, world: int, point: str, transport: str, path: str) -> str:
    model = fully_shard_model(make_model(), [Block], host_transport=transport)
    optimizer = fully_shard_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-2))
    for step, (tokens, targets) in enumerate(make_batches(4, 4)):
        if step == FAULT_STEP and rank == VICTIM:
            _arm(point, model, optimizer, path)
        loss = loss_fn(model(local_slice(tokens, rank, world)), local_slice(targets, rank, world))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        if step == FAULT_STEP:
            mc.save_checkpoint(path, model, optimizer)
    return "trained to the end although a peer died"


@pytest.mark.parametrize("transport", ["auto", "gloo"])
@pytest.mark.parametrize("point", ["forward", "backward", "optimizer_step", "save_checkpoint"])
def test_a_killed_rank_is_named_by_the_survivor(point: str, transport: str, tmp_path: Path) -> None:
    outcomes = run_distributed_outcomes(
        _train_until_killed, 2, point, transport, str(tmp_path / "ckpt"), timeout=90
    )
    death, survivor = outcomes[VICTIM], outcomes[1 - VICTIM]
    assert death.died, death
    assert survivor.error is not None, survivor.result
    error = survivor.error.exception
    assert isinstance(error, PeerDiedError), survivor.error
    assert error.ranks == [VICTIM], error
    assert f"rank {VICTIM} (pid" in str(error), error
    delay = survivor.at - death.at
    assert delay < RAISE_WITHIN_S, f"the survivor raised {delay:.1f}s after the death"


JOB = Path(__file__).with_name("fault_job.py")


def test_under_torchrun_the_job_exits_non_zero() -> None:
    start = time.monotonic()
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node=2",
            str(JOB),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    elapsed = time.monotonic() - start
    assert done.returncode != 0, done.stdout + done.stderr
    assert "SIGKILL" in done.stderr or "Signal 9" in done.stderr, done.stderr[-3000:]
    assert elapsed < 90, f"the job took {elapsed:.0f}s to end"
