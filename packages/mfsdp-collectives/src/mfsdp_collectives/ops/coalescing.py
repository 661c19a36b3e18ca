"""Several all-gathers as one collective: ``coalesced_gathers()`` (the package README's
"Coalesced all-gathers"). One collective per (group, transport, dtype, device, stream);
waiting on a queued handle issues its queue first, so no handle waits on a collective never
issued, and a later gather in the block starts a new queue. As for any collective, every rank
must queue the same gathers in the same order.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from ..core._compat import Work, all_gather_single
from ..core.naming import group_name
from ..host.shm import SharedMemoryTransport
from ..issuing.handle import CommHandle
from ..issuing.stages import issue_stages
from ..tracing.tracer import record_comm

__all__ = ["GatherRoute", "coalesced_gathers", "issue_all_gather", "queued_gathers"]

_local = threading.local()


@dataclass(frozen=True)
class GatherRoute:
    """Where an all-gather goes: its group (of ``size`` ranks), the shared-memory transport
    carrying it or None for c10d, and the side stream it is issued on (None: the host)."""

    group: dist.ProcessGroup
    size: int
    transport: SharedMemoryTransport | None
    side: torch.Stream | None


def issue_all_gather(
    pairs: Sequence[tuple[torch.Tensor, torch.Tensor]], route: GatherRoute, *, async_op: bool
) -> CommHandle:
    """One all-gather filling each ``(shard, unsharded)`` pair's ``unsharded`` (flat, of one
    dtype and device, checked by the caller) with every rank's ``shard``."""
    shards = [shard for shard, _ in pairs]
    outputs = [unsharded for _, unsharded in pairs]
    total = sum(shard.numel() for shard in shards)
    name = group_name(route.group)
    if route.size > 1:
        record_comm("all_gather", name, total, shards[0].dtype)
    received: list[torch.Tensor] = []  # c10d, several pairs: the send and receive buffers
    issue: Callable[[], Work | None]
    finish: Callable[[], None] | None = None
    if route.size == 1:  # one rank: nothing to exchange, no collective (FSDP2 issues none)

        def issue() -> Work | None:
            for shard, unsharded in pairs:
                if shard.data_ptr() != unsharded.data_ptr():  # not gathered in place
                    unsharded.copy_(shard)
            return None

    elif route.transport is not None:
        transport = route.transport

        def issue() -> Work | None:
            return transport.all_gather_many(outputs, shards)

    elif len(pairs) == 1:

        def issue() -> Work | None:
            return all_gather_single(outputs[0], shards[0], route.group, async_op=True)

    else:

        def issue() -> Work | None:
            send = torch.cat(shards)
            received[:] = [send, send.new_empty(route.size * total)]
            return all_gather_single(received[1], send, route.group, async_op=True)

        def finish() -> None:
            by_rank, offset = received[1].view(route.size, total), 0
            for shard, unsharded in pairs:
                n = shard.numel()
                unsharded.view(route.size, n).copy_(by_rank[:, offset : offset + n])
                offset += n

    label = f"all_gather on group {name}"
    return issue_stages(
        [(route.side, issue)],
        device=shards[0].device,
        finish=finish,
        async_op=async_op,
        keep_alive=(*shards, *outputs, received),
        reads=shards,
        writes=outputs,
        label=label if len(pairs) == 1 else f"{label} ({len(pairs)} coalesced)",
    )


@dataclass
class _Queue:
    """Gathers of one route and dtype waiting to go out as one collective."""

    route: GatherRoute
    pairs: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)
    handle: CommHandle | None = None

    def issue(self) -> CommHandle:
        if self.handle is None:
            self.handle = issue_all_gather(self.pairs, self.route, async_op=True)
        return self.handle


class _Queued:
    """The work of one queued gather: waiting on it issues its queue."""

    def __init__(self, queue: _Queue) -> None:
        self._queue = queue

    def wait(self) -> bool:
        self._queue.issue().wait()
        return True

    def is_completed(self) -> bool:
        handle = self._queue.handle
        return handle is not None and handle.is_completed()


class GatherQueues:
    """The all-gathers queued by the innermost open ``coalesced_gathers`` block."""

    def __init__(self) -> None:
        self._queues: dict[tuple[object, ...], _Queue] = {}

    def add(self, shard: torch.Tensor, unsharded: torch.Tensor, route: GatherRoute) -> CommHandle:
        key = (id(route.group), id(route.transport), id(route.side), shard.dtype, shard.device)
        queue = self._queues.get(key)
        if queue is None or queue.handle is not None:  # none yet, or already waited on
            queue = self._queues[key] = _Queue(route)
        queue.pairs.append((shard, unsharded))
        label = f"all_gather on group {group_name(route.group)}"
        return CommHandle((_Queued(queue),), keep_alive=(shard, unsharded), label=label)

    def issue(self) -> None:
        queues, self._queues = list(self._queues.values()), {}
        for queue in queues:
            queue.issue()


def queued_gathers() -> GatherQueues | None:
    """The queues of this thread's open ``coalesced_gathers`` block, if any."""
    queues: GatherQueues | None = getattr(_local, "queues", None)
    return queues


@contextlib.contextmanager
def coalesced_gathers() -> Iterator[None]:
    """Queue this thread's ``all_gather_into`` calls and issue them, one collective per
    group and dtype, when the block ends. Inside an open block it only joins that one.

    If the block raises, what it queued is issued only when waited on."""
    if queued_gathers() is not None:
        yield
        return
    queues = _local.queues = GatherQueues()
    try:
        yield
    except BaseException:
        _local.queues = None
        raise
    _local.queues = None
    queues.issue()
