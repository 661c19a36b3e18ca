"""The shared-memory transport of a planning run: the engine's route, no bytes moved.

On one host the engine's CPU reductions read autograd's gradients in place (``FlatPieces``)
over shared memory, so a real CPU run holds less than the c10d route would. A planning run
on torch's fake group (``megatron_fsdp.plan_memory``) must take the same route to hold what a
real rank holds: each collective here touches no byte and lands when the engine waits. A real
mailbox is mapped memory, not tensors: no tracker counts it in either run (``mapped_bytes``).
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import Future

import torch
import torch.distributed as dist

from mfsdp_buffers import FlatPieces

from .collective_worker import BackgroundWork
from .shm import SharedMemoryTransport

__all__ = ["FakeHostTransport"]


class _LandsWhenWaited(BackgroundWork):
    """A collective that has landed once waited for, and not before: where the engine polls
    (to free what a reduction read early), the plan holds it until the engine's own wait,
    the latest a real transport can keep it, so the plan is the run's upper bound."""

    def __init__(self) -> None:
        future: Future[None] = Future()
        future.set_result(None)
        super().__init__(future)
        self._waited = False

    def wait(self) -> bool:
        self._waited = True
        return True

    def is_completed(self) -> bool:
        return self._waited


class FakeHostTransport(SharedMemoryTransport):
    """A ``SharedMemoryTransport`` for a fake group: same route, every collective done."""

    def __init__(self, group: dist.ProcessGroup) -> None:  # no mailboxes, no workers
        self.group = group
        self.rank = dist.get_rank(group)
        self.size = dist.get_world_size(group)
        self.chunk_bytes = 0
        self.timeout_s = 0.0
        self.concurrent_reductions = True
        self._open = True

    def close(self) -> None:
        self._open = False

    @property
    def closed(self) -> bool:
        return not self._open

    @property
    def mapped_bytes(self) -> int:
        return 0

    def all_gather_many(
        self, outputs: Sequence[torch.Tensor], shards: Sequence[torch.Tensor]
    ) -> BackgroundWork:
        return _LandsWhenWaited()

    def reduce_scatter(
        self, output: torch.Tensor, inp: torch.Tensor | FlatPieces, average: bool
    ) -> BackgroundWork:
        return _LandsWhenWaited()
