"""The shared-memory transport of a planning run: the engine's route, no bytes moved.

On one host the engine hands CPU reductions to the shared-memory transport, which reads
autograd's gradients in place (``FlatPieces``) instead of packing them into a flat reduce
buffer: a real CPU run holds less than the c10d route would. A planning run on torch's fake
process group (``megatron_fsdp.plan_memory``) has no peers to share memory with, yet must
take the same route to hold what a real rank holds. ``enable_host_transport`` gives a fake
group this transport: the engine routes through it exactly as through the real one, and
each collective, which touches no byte (the tensors are fake), lands when the engine waits.

The transport's own mailbox is mapped memory, not tensors: no tracker counts it in either run.
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
