"""Intra-host all-gather and reduce-scatter through shared memory, for CPU groups.

Gloo moves every byte through TCP loopback: a kernel copy on each side plus
its own staging buffers, about 0.4 GB/s per rank on a small box, and all of
it CPU time that the ranks' compute threads need. When every rank of a group
runs on one host, the same collectives are a few memcpys through a mapped
file, an order of magnitude cheaper. This is what NCCL's SHM transport does
between GPUs of one node.

Each rank maps a *mailbox*: a control word and two slots of ``chunk_bytes``.
A collective is cut into steps of at most one slot; in step ``k`` every rank
writes its contribution into slot ``k % 2``, publishes ``k`` in its control
word, waits until every peer has published ``k``, then reads the peers' slots.
A peer that has published ``k`` has finished reading step ``k - 1``, so the
slot written at step ``k + 1`` is free: one wait per step, no second barrier.
Waiting is a futex sleep on the peer's control word, which the peer wakes when
it publishes: no spinning thread steals CPU from compute. The ordering argument
relies on x86-64 store ordering (TSO), so the transport is only offered on
Linux x86-64.

Collectives run on one worker thread per group, in the order they were issued
(which is the same on every rank, as for any backend), and return a ``Work``
whose ``wait()`` joins them. A peer whose process dies makes the wait fail
within ``_LIVENESS_PERIOD_S`` with a ``PeerDiedError`` naming its rank (the waiting
loop checks the peers' processes, see ``liveness``); a peer that is alive but stops
issuing collectives makes it fail after ``timeout_s`` instead of hanging.

Each collective is a profiler range, ``mfsdp_shm:all_gather`` or
``mfsdp_shm:reduce_scatter`` with the group and the bytes in its name, opened on the
issuing thread and closed when the worker finishes it, as c10d's ``gloo:*`` ranges are:
``torch.profiler`` traces show where the communication went.

Setting a transport up (which groups qualify, the mailbox files) is ``host_transport``'s job.
"""

from __future__ import annotations

import atexit
import ctypes
import mmap
import os
import queue
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future

import torch
import torch.distributed as dist
from torch.autograd.profiler import record_function

from mfsdp_buffers import FlatPieces

from . import _futex
from .liveness import ProcessIdentity, peer_died_error
from .naming import group_name

__all__ = ["DEFAULT_CHUNK_BYTES", "DEFAULT_TIMEOUT_S", "SharedMemoryTransport"]

DEFAULT_CHUNK_BYTES = 1 << 20
DEFAULT_TIMEOUT_S = 600.0
_CONTROL_BYTES = 64  # one cache line: the published step counter
_STEP_MASK = 0x7FFFFFFF
_HALF_RANGE = 1 << 30
# A waiting rank looks at its peers' processes this often: a dead peer is named within it.
_LIVENESS_PERIOD_S = 0.5
ALIGN = 64


class _Mailbox:
    """A mapped file: control word, then two slots of ``slot_bytes``."""

    def __init__(self, path: str, slot_bytes: int, *, create: bool) -> None:
        size = _CONTROL_BYTES + 2 * slot_bytes
        flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0)
        fd = os.open(path, flags, 0o600)
        try:
            if create:
                os.ftruncate(fd, size)
            self._map = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        # The published step, modulo 2**31, as a futex word peers can sleep on.
        self.control = ctypes.c_int32.from_buffer(self._map)
        # frombuffer issues no aten op, so tensor-tracking dispatch modes (memory tests,
        # benchmarks) do not see the mapping: its bytes are reported by ``mapped_bytes``.
        self.slots = tuple(
            torch.frombuffer(self._map, dtype=torch.uint8, count=slot_bytes, offset=offset)
            for offset in (_CONTROL_BYTES, _CONTROL_BYTES + slot_bytes)
        )


class _SharedMemoryWork:
    """The ``Work`` of one collective running on the transport's thread."""

    def __init__(self, future: Future[None]) -> None:
        self._future = future

    def wait(self) -> bool:
        self._future.result()
        return True

    def is_completed(self) -> bool:
        return self._future.done()


class SharedMemoryTransport:
    """All-gather and reduce-scatter for the ranks of one host-local CPU group.

    Build it with :func:`enable_host_transport` (a collective over ``group``),
    which decides whether the group qualifies; the ops in ``mfsdp_collectives``
    route this group's all-gathers and reduce-scatters through it when given it
    as ``transport=`` (``FSDPTopology.host_transport`` holds the engine's).
    """

    def __init__(
        self,
        group: dist.ProcessGroup,
        mailboxes: list[_Mailbox],
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
        self._boxes = mailboxes
        self._own = mailboxes[rank]
        self._step = 0
        self._name = group_name(group)
        # The peers' processes, by group rank, and their global ranks (for the error).
        self._peers = list(peers)
        self._global_ranks = [dist.get_global_rank(group, r) for r in range(self.size)]
        self._failed: BaseException | None = None
        self._queue: queue.SimpleQueue[_Job] = queue.SimpleQueue()
        # A daemon thread: a rank that exits with a collective still waiting for its peers
        # must not be held at interpreter exit.
        worker = threading.Thread(
            target=_serve, args=(self._queue,), name=f"mfsdp-shm-{self._name}", daemon=True
        )
        worker.start()
        self._worker = worker
        # Stop an idle worker before the interpreter finalises, so no thread of ours is
        # parked there while torch and gloo tear down.
        atexit.register(_stop, self._queue, worker)

    def close(self) -> None:
        """Finish the queued collectives, stop the worker and drop the mappings."""
        if self._failed is None:
            self._failed = RuntimeError("the transport was closed")
        _stop(self._queue, self._worker, timeout_s=self.timeout_s)
        self._boxes = []

    @property
    def closed(self) -> bool:
        """True once ``close`` ran (``disable_host_transport``): its group is c10d's again."""
        return not self._boxes

    @property
    def mapped_bytes(self) -> int:
        """Bytes this rank maps for its own mailbox (its staging memory)."""
        return _CONTROL_BYTES + 2 * self.chunk_bytes

    def all_gather(self, output: torch.Tensor, shard: torch.Tensor) -> _SharedMemoryWork:
        """Concatenate every rank's flat ``shard`` into flat ``output`` (async)."""
        return self.all_gather_many([output], [shard])

    def all_gather_many(
        self, outputs: Sequence[torch.Tensor], shards: Sequence[torch.Tensor]
    ) -> _SharedMemoryWork:
        """Each ``outputs[i]`` gets every rank's ``shards[i]``, as one collective: the shards
        (of one dtype) are exchanged end to end, so k small gathers cost one rendezvous."""
        if len({s.dtype for s in shards}) != 1 or len(outputs) != len(shards):
            raise ValueError(
                "all_gather_many takes one output per shard and shards of one dtype, got "
                f"{len(outputs)} outputs for shards of {[s.dtype for s in shards]}"
            )
        nbytes = sum(s.numel() for s in shards) * shards[0].element_size()
        return self._submit(
            "all_gather", nbytes, self._all_gather_many, list(outputs), list(shards)
        )

    def reduce_scatter(
        self, output: torch.Tensor, inp: torch.Tensor | FlatPieces, average: bool
    ) -> _SharedMemoryWork:
        """``output = sum_or_mean_i inp_i[rank chunk]`` over the ranks (async).

        ``inp`` may be ``FlatPieces``: its chunks are read straight from the pieces.

        The pieces are added in rank order (fp32 for 16-bit dtypes), so the result is
        the same on every run and at least as accurate as gloo's.
        """
        return self._submit(
            "reduce_scatter",
            (inp.numel() if isinstance(inp, torch.Tensor) else inp.numel) * inp.dtype.itemsize,
            self._reduce_scatter,
            output,
            inp,
            average,
        )

    def _submit(
        self, op: str, nbytes: int, fn: Callable[..., None], *args: object
    ) -> _SharedMemoryWork:
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
            span = _open_range(f"mfsdp_shm:{op} (group={self._name}, bytes={nbytes})")
            self._queue.put((future, lambda: self._guarded(span, fn, *args)))
        return _SharedMemoryWork(future)

    def _guarded(self, span: record_function, fn: Callable[..., None], *args: object) -> None:
        try:
            fn(*args)
        except BaseException as exc:
            self._failed = exc
            raise
        finally:
            _close_range(span)

    def _elements_per_step(self, dtype: torch.dtype, pieces: int) -> int:
        per_piece = (self.chunk_bytes // max(pieces, 1)) // ALIGN * ALIGN
        return max(per_piece // dtype.itemsize, 1)

    def _slot(self, box: _Mailbox, dtype: torch.dtype) -> torch.Tensor:
        return box.slots[self._step % 2].view(dtype)

    def _exchange(self) -> None:
        """Publish this step and wait until every peer has published it too."""
        step = self._step & _STEP_MASK
        self._own.control.value = step
        _futex.wake(self._own.control)
        start = time.monotonic()
        deadline, next_check = start + self.timeout_s, start + _LIVENESS_PERIOD_S
        for peer, box in enumerate(self._boxes):
            while True:
                seen = box.control.value
                if (seen - step) & _STEP_MASK < _HALF_RANGE:  # seen >= step, modulo 2**31
                    break
                now = time.monotonic()
                if now >= next_check:
                    self._raise_if_a_peer_died()
                    next_check = now + _LIVENESS_PERIOD_S
                if now >= deadline:
                    raise TimeoutError(
                        f"shared-memory collective on group {self._name} waited "
                        f"{self.timeout_s:.0f}s for rank {peer} at step {step}: a rank stopped "
                        "issuing collectives (it hangs, or the ranks issued different "
                        "collectives in a different order)"
                    )
                _futex.wait(box.control, seen, min(deadline, next_check) - now)

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

    def _all_gather_many(self, outputs: list[torch.Tensor], shards: list[torch.Tensor]) -> None:
        dtype = shards[0].dtype
        sizes = [shard.numel() for shard in shards]
        for output, shard, n in zip(outputs, shards, sizes, strict=True):
            own = output[self.rank * n : (self.rank + 1) * n]
            if own.data_ptr() != shard.data_ptr():
                own.copy_(shard)
        per_step = self._elements_per_step(dtype, 1)
        for start in range(0, sum(sizes), per_step):
            segments = _segments(sizes, start, start + per_step)
            self._step += 1
            slot = self._slot(self._own, dtype)
            for index, lo, hi, at in segments:
                slot[at : at + hi - lo].copy_(shards[index][lo:hi])
            self._exchange()
            for peer, box in enumerate(self._boxes):
                if peer == self.rank:
                    continue
                theirs = self._slot(box, dtype)
                for index, lo, hi, at in segments:
                    n = sizes[index]
                    outputs[index][peer * n + lo : peer * n + hi].copy_(theirs[at : at + hi - lo])

    def _reduce_scatter(
        self, output: torch.Tensor, inp: torch.Tensor | FlatPieces, average: bool
    ) -> None:
        n = output.numel()
        peers = self.size - 1
        per_step = self._elements_per_step(inp.dtype, peers)
        # Low-precision pieces are summed in fp32 and rounded once, into ``output``.
        wide = output.is_floating_point() and output.element_size() < 4
        scratch = torch.empty(min(per_step, n), dtype=torch.float32) if wide else None
        # Every rank adds the same ranks' pieces in the same order (0, 1, ...).
        for start in range(0, n, per_step):
            stop = min(start + per_step, n)
            width = stop - start
            self._step += 1
            slot = self._slot(self._own, inp.dtype)
            for i, dst in enumerate(d for d in range(self.size) if d != self.rank):
                _read_into(slot[i * width : (i + 1) * width], inp, dst * n + start)
            self._exchange()
            out = output[start:stop]
            acc = scratch[:width] if scratch is not None else out
            for j, src in enumerate(range(self.size)):
                if src == self.rank:
                    _add_into(acc, inp, self.rank * n + start, first=j == 0)
                    continue
                at = src_index(self.rank, src)
                piece = self._slot(self._boxes[src], inp.dtype)[at * width : (at + 1) * width]
                if j == 0:
                    acc.copy_(piece)
                else:
                    acc.add_(piece)
            if average:
                acc.div_(self.size)
            if acc is not out:
                out.copy_(acc)


def _segments(sizes: Sequence[int], start: int, stop: int) -> list[tuple[int, int, int, int]]:
    """``(index, lo, hi, at)``: elements ``[lo, hi)`` of shard ``index`` are elements
    ``[at, at + hi - lo)`` of the slot of the step carrying ``[start, stop)`` of the shards
    laid end to end."""
    segments, offset = [], 0
    for index, n in enumerate(sizes):
        lo, hi = max(start - offset, 0), min(stop - offset, n)
        if lo < hi:
            segments.append((index, lo, hi, offset + lo - start))
        offset += n
    return segments


def _open_range(name: str) -> record_function:
    """Open a profiler range on the issuing thread (a no-op when no profiler listens)."""
    span = record_function(name)
    span.__enter__()  # type: ignore[no-untyped-call]
    return span


def _close_range(span: record_function) -> None:
    """Close, on the worker thread, the range the issuing thread opened."""
    span.__exit__(None, None, None)


def _read_into(dst: torch.Tensor, inp: torch.Tensor | FlatPieces, start: int) -> None:
    if isinstance(inp, FlatPieces):
        inp.copy_range_into(dst, start)
    else:
        dst.copy_(inp[start : start + dst.numel()])


def _add_into(acc: torch.Tensor, inp: torch.Tensor | FlatPieces, start: int, first: bool) -> None:
    if first:
        _read_into(acc, inp, start)
    elif isinstance(inp, FlatPieces):
        inp.add_range_into(acc, start)
    else:
        acc.add_(inp[start : start + acc.numel()])


_Job = tuple[Future[None], Callable[[], None]] | None


def _stop(jobs: queue.SimpleQueue[_Job], worker: threading.Thread, timeout_s: float = 1.0) -> None:
    jobs.put(None)
    worker.join(timeout=timeout_s)  # a worker stuck waiting for a dead peer stays a daemon


def _serve(jobs: queue.SimpleQueue[_Job]) -> None:
    """The worker loop: run each collective in issue order, completing its future."""
    while True:
        item = jobs.get()
        if item is None:
            return
        future, job = item
        try:
            job()
        except BaseException as exc:
            future.set_exception(exc)
        else:
            future.set_result(None)
        # Drop the job before blocking on the next one: it holds the collective's tensors.
        del future, job, item


def src_index(dst: int, src: int) -> int:
    """Position of ``dst``'s piece in ``src``'s slot (``src`` skips itself)."""
    return dst if dst < src else dst - 1
