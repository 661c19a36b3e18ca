"""Intra-host all-gather and reduce-scatter through shared memory, for CPU groups (the
package README's "Shared-memory host transport": lanes, ordering, failures, profiler ranges).

Gloo moves every byte through TCP loopback (a kernel copy each side, and CPU time the ranks'
compute needs); through a mapped file the same collectives are a few memcpys, as NCCL's SHM
transport does between GPUs of one node. The lane protocol (``shm_lane``) relies on x86-64
store ordering (TSO). A failure on one lane fails the later collectives on both: the ranks'
step counters no longer agree. Setting a transport up is ``host_transport``'s job.
"""

from __future__ import annotations

import atexit
from collections.abc import Callable, Sequence
from concurrent.futures import Future

import torch
import torch.distributed as dist
from torch.autograd.profiler import record_function

from mfsdp_buffers import FlatPieces

from ..core.naming import group_name
from ..safety.liveness import ProcessIdentity, peer_died_error
from ..tracing.mode_echo import echo_all_gather, echo_reduce_scatter
from .collective_worker import BackgroundWork
from .shm_lane import CONTROL_BYTES, Lane, MailboxFile, PeerWatch

__all__ = ["DEFAULT_CHUNK_BYTES", "DEFAULT_TIMEOUT_S", "SharedMemoryTransport"]

DEFAULT_CHUNK_BYTES = 1 << 20
DEFAULT_TIMEOUT_S = 600.0
LANES = 2  # all-gathers, reduce-scatters
_GATHERS, _REDUCTIONS = 0, 1


class SharedMemoryTransport:
    """All-gather and reduce-scatter for the ranks of one host-local CPU group; built by
    ``enable_host_transport`` (a collective over ``group``), used when passed as ``transport=``."""

    def __init__(
        self,
        group: dist.ProcessGroup,
        mailboxes: list[MailboxFile],
        rank: int,
        *,
        chunk_bytes: int,
        timeout_s: float,
        peers: Sequence[ProcessIdentity],
    ) -> None:
        self.group = group
        self.rank = rank
        self.size = len(mailboxes)
        self.chunk_bytes = chunk_bytes
        self.timeout_s = timeout_s
        self.concurrent_reductions = True
        """Reduce-scatters on their own lane (True), or queued behind the all-gathers on
        theirs. Change it on every rank at the same point, between collectives."""
        self._name = group_name(group)
        # The peers' processes, by group rank, and their global ranks (for the error).
        self._peers = list(peers)
        self._global_ranks = [dist.get_global_rank(group, r) for r in range(self.size)]
        self._failed: BaseException | None = None
        watch = PeerWatch(self._name, timeout_s, self._raise_if_a_peer_died)
        self._lanes = [
            Lane(
                f"mfsdp-shm-{self._name}-{kind}",
                [box.lanes[index] for box in mailboxes],
                rank,
                chunk_bytes,
                watch,
            )
            for index, kind in enumerate(("gather", "reduce"))
        ]
        # Stop idle workers before the interpreter finalises, so no thread of ours is
        # parked there while torch and gloo tear down.
        for lane in self._lanes:
            atexit.register(lane.stop)

    def close(self) -> None:
        """Finish the queued collectives, stop the workers and drop the mappings."""
        if self._failed is None:
            self._failed = RuntimeError("the transport was closed")
        for lane in self._lanes:
            lane.stop(timeout_s=self.timeout_s)
        self._lanes = []

    @property
    def closed(self) -> bool:
        """True once ``close`` ran (``disable_host_transport``): its group is c10d's again."""
        return not self._lanes

    @property
    def mapped_bytes(self) -> int:
        """Bytes this rank maps for its own mailbox (its staging memory)."""
        return LANES * (CONTROL_BYTES + 2 * self.chunk_bytes)

    def all_gather_many(
        self, outputs: Sequence[torch.Tensor], shards: Sequence[torch.Tensor]
    ) -> BackgroundWork:
        """Each ``outputs[i]`` gets every rank's ``shards[i]``, as one collective: the shards
        (of one dtype) are exchanged end to end, so k small gathers cost one rendezvous."""
        if len({s.dtype for s in shards}) != 1 or len(outputs) != len(shards):
            raise ValueError(
                "all_gather_many takes one output per shard and shards of one dtype, got "
                f"{len(outputs)} outputs for shards of {[s.dtype for s in shards]}"
            )
        numel = sum(s.numel() for s in shards)
        echo_all_gather(self.group, self.size, numel, shards[0].dtype)
        lane = self._lanes[_GATHERS]
        nbytes = numel * shards[0].element_size()
        return self._submit(
            lane, "all_gather", nbytes, lane.all_gather_many, list(outputs), list(shards)
        )

    def reduce_scatter(
        self, output: torch.Tensor, inp: torch.Tensor | FlatPieces, average: bool
    ) -> BackgroundWork:
        """``output = sum_or_mean_i inp_i[rank chunk]`` over the ranks (async); ``inp`` may be
        ``FlatPieces``, read in place. Added in rank order (fp32 for 16-bit dtypes): the same
        result every run, at least as accurate as gloo's."""
        numel = inp.numel() if isinstance(inp, torch.Tensor) else inp.numel
        echo_reduce_scatter(self.group, self.size, numel, inp.dtype, average=average)
        lane = self._lanes[_REDUCTIONS if self.concurrent_reductions else _GATHERS]
        return self._submit(
            lane,
            "reduce_scatter",
            numel * inp.dtype.itemsize,
            lane.reduce_scatter,
            output,
            inp,
            average,
        )

    def _submit(
        self, lane: Lane, op: str, nbytes: int, fn: Callable[..., None], *args: object
    ) -> BackgroundWork:
        future: Future[None] = Future()
        if self._failed is not None:
            # The step counters of the ranks no longer agree: nothing after a failure is safe.
            future.set_exception(
                RuntimeError(
                    f"the shared-memory transport of group {self._name} failed earlier "
                    f"({self._failed!r}); restart the job"
                )
            )
        else:
            # A profiler range opened on the issuing thread, closed by the worker (``_guarded``).
            span = record_function(f"mfsdp_shm:{op} (group={self._name}, bytes={nbytes})")
            span.__enter__()  # type: ignore[no-untyped-call]
            lane.jobs.put((future, lambda: self._guarded(span, fn, *args)))
        return BackgroundWork(future)

    def _guarded(self, span: record_function, fn: Callable[..., None], *args: object) -> None:
        try:
            fn(*args)
        except BaseException as exc:
            self._failed = exc
            raise
        finally:
            span.__exit__(None, None, None)

    def _raise_if_a_peer_died(self) -> None:
        # Every peer, not just the awaited one: the awaited one may be alive and itself
        # stuck waiting for the dead one.
        dead = [
            self._global_ranks[r]
            for r, ident in enumerate(self._peers)
            if r != self.rank and ident.is_alive() is False
        ]
        if dead:
            raise peer_died_error(dead, f"a shared-memory collective on group {self._name}")
