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
whose ``wait()`` joins them. A peer that stops issuing collectives makes the
wait fail after ``timeout_s`` instead of hanging.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import mmap
import os
import platform
import queue
import socket
import tempfile
import threading
import time
import uuid
import weakref
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass

import torch
import torch.distributed as dist

from mfsdp_buffers import FlatPieces

from . import _futex
from .naming import group_name

__all__ = [
    "DEFAULT_CHUNK_BYTES",
    "HOST_TRANSPORTS",
    "SharedMemoryTransport",
    "check_host_transport",
    "disable_host_transport",
    "enable_host_transport",
    "host_transport_of",
]

HOST_TRANSPORTS = ("auto", "shm", "gloo")
DEFAULT_CHUNK_BYTES = 1 << 20
DEFAULT_TIMEOUT_S = 600.0
_CONTROL_BYTES = 64  # one cache line: the published step counter
_STEP_MASK = 0x7FFFFFFF
_HALF_RANGE = 1 << 30
_WAIT_SLICE_S = 0.5
_ALIGN = 64
_SHM_DIR = "/dev/shm"
_X86_64 = frozenset({"x86_64", "amd64"})

_transports: weakref.WeakKeyDictionary[dist.ProcessGroup, SharedMemoryTransport] = (
    weakref.WeakKeyDictionary()
)
_registry_lock = threading.Lock()
_OWN_BOXES: dict[str, _Mailbox] = {}  # created, not yet shared: path -> mailbox


@dataclass(frozen=True)
class _HostFacts:
    """What every rank reports so that all take the same transport decision."""

    host: str
    arch_ok: bool
    path: str | None


def _boot_id() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id", encoding="ascii") as f:
            return f.read().strip()
    except OSError:
        return ""


def _shm_dir() -> str | None:
    for candidate in (_SHM_DIR, tempfile.gettempdir()):
        if os.path.isdir(candidate) and os.access(candidate, os.W_OK):
            return candidate
    return None


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
    then route this group's all-gathers and reduce-scatters through it.
    """

    def __init__(
        self,
        group: dist.ProcessGroup,
        mailboxes: list[_Mailbox],
        rank: int,
        *,
        chunk_bytes: int,
        timeout_s: float,
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
    def mapped_bytes(self) -> int:
        """Bytes this rank maps for its own mailbox (its staging memory)."""
        return _CONTROL_BYTES + 2 * self.chunk_bytes

    def all_gather(self, output: torch.Tensor, shard: torch.Tensor) -> _SharedMemoryWork:
        """Concatenate every rank's flat ``shard`` into flat ``output`` (async)."""
        return self._submit(self._all_gather, output, shard)

    def reduce_scatter(
        self, output: torch.Tensor, inp: torch.Tensor | FlatPieces, average: bool
    ) -> _SharedMemoryWork:
        """``output = sum_or_mean_i inp_i[rank chunk]`` over the ranks (async).

        ``inp`` may be ``FlatPieces``: its chunks are read straight from the pieces.

        The pieces are added in rank order (fp32 for 16-bit dtypes), so the result is
        the same on every run and at least as accurate as gloo's.
        """
        return self._submit(self._reduce_scatter, output, inp, average)

    def _submit(self, fn: Callable[..., None], *args: object) -> _SharedMemoryWork:
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
            self._queue.put((future, lambda: self._guarded(fn, *args)))
        return _SharedMemoryWork(future)

    def _guarded(self, fn: Callable[..., None], *args: object) -> None:
        try:
            fn(*args)
        except BaseException as exc:
            self._failed = exc
            raise

    def _elements_per_step(self, dtype: torch.dtype, pieces: int) -> int:
        per_piece = (self.chunk_bytes // max(pieces, 1)) // _ALIGN * _ALIGN
        return max(per_piece // dtype.itemsize, 1)

    def _slot(self, box: _Mailbox, dtype: torch.dtype) -> torch.Tensor:
        return box.slots[self._step % 2].view(dtype)

    def _exchange(self) -> None:
        """Publish this step and wait until every peer has published it too."""
        step = self._step & _STEP_MASK
        self._own.control.value = step
        _futex.wake(self._own.control)
        deadline = time.monotonic() + self.timeout_s
        for peer, box in enumerate(self._boxes):
            while True:
                seen = box.control.value
                if (seen - step) & _STEP_MASK < _HALF_RANGE:  # seen >= step, modulo 2**31
                    break
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(
                        f"shared-memory collective on group {self._name} waited "
                        f"{self.timeout_s:.0f}s for rank {peer} at step {step}: a rank stopped "
                        "issuing collectives (it crashed, or the ranks issued different "
                        "collectives in a different order)"
                    )
                _futex.wait(box.control, seen, min(left, _WAIT_SLICE_S))

    def _all_gather(self, output: torch.Tensor, shard: torch.Tensor) -> None:
        n = shard.numel()
        own = output[self.rank * n : (self.rank + 1) * n]
        if own.data_ptr() != shard.data_ptr():
            own.copy_(shard)
        per_step = self._elements_per_step(shard.dtype, 1)
        for start in range(0, n, per_step):
            stop = min(start + per_step, n)
            self._step += 1
            self._slot(self._own, shard.dtype)[: stop - start].copy_(shard[start:stop])
            self._exchange()
            for peer, box in enumerate(self._boxes):
                if peer != self.rank:
                    dst = output[peer * n + start : peer * n + stop]
                    dst.copy_(self._slot(box, shard.dtype)[: stop - start])

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


def check_host_transport(value: object) -> None:
    """Raise unless ``value`` names a host transport (local check, no collective)."""
    if value not in HOST_TRANSPORTS:
        raise ValueError(
            f"host_transport={value!r} is not one of {HOST_TRANSPORTS}; pass 'auto' "
            "(shared memory when all ranks share a host), 'shm' or 'gloo'"
        )


def host_transport_of(group: dist.ProcessGroup) -> SharedMemoryTransport | None:
    """The shared-memory transport serving ``group``, if one was enabled."""
    with _registry_lock:
        return _transports.get(group)


def disable_host_transport(group: dist.ProcessGroup | None = None) -> None:
    """Return ``group``'s all-gathers and reduce-scatters to gloo (local, no collective).

    Collectives already issued complete first; then the worker thread stops and the
    mailboxes are unmapped. ``None`` does this for every group that has a transport. Call
    it on every rank at the same point of the program, e.g. before
    ``dist.destroy_process_group``; a group without a transport is left as it is.
    """
    with _registry_lock:
        if group is None:
            closing = list(_transports.values())
            _transports.clear()
        else:
            found = _transports.pop(group, None)
            closing = [found] if found is not None else []
    for transport in closing:
        transport.close()


def enable_host_transport(
    group: dist.ProcessGroup,
    transport: str = "auto",
    *,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    timeout_s: float = DEFAULT_TIMEOUT_S,
) -> SharedMemoryTransport | None:
    """Choose how ``group``'s CPU all-gathers and reduce-scatters travel (collective).

    ``"gloo"`` keeps the process group's own collectives. ``"shm"`` requires the
    shared-memory transport and raises naming what is missing; ``"auto"`` takes
    it when every rank of ``group`` is on this host (same machine and boot), the
    CPU is x86-64, the backend is gloo and a shared-memory directory is writable,
    and otherwise quietly keeps gloo. Every rank reaches the same decision.
    Calling it again for a group that already has a transport returns that one.
    """
    check_host_transport(transport)
    if isinstance(chunk_bytes, bool) or not isinstance(chunk_bytes, int) or chunk_bytes < 4096:
        raise ValueError(f"chunk_bytes={chunk_bytes!r} must be an int >= 4096")
    if transport == "gloo":
        return None
    existing = host_transport_of(group)
    if existing is not None:
        return existing
    backend = str(dist.get_backend(group)).lower()
    if backend != "gloo":
        if transport == "shm":
            raise ValueError(
                f"host_transport='shm' needs a gloo (CPU) group, but group "
                f"{group_name(group)} uses {backend}; pass host_transport='auto' or 'gloo'"
            )
        return None
    slot_bytes = chunk_bytes // _ALIGN * _ALIGN
    facts = _gather_facts(group, slot_bytes)
    reason = _unsuitable(facts)
    if reason is not None:
        _remove_own(facts[dist.get_rank(group)])
        if transport == "shm":
            raise ValueError(
                f"host_transport='shm' is not possible for group {group_name(group)}: {reason}; "
                "pass host_transport='auto' or 'gloo'"
            )
        return None
    rank = dist.get_rank(group)
    boxes, failure = _map_all(facts, rank, slot_bytes)
    # Every rank learns whether every rank mapped every mailbox (after this, the names can
    # go), so that a failure on one rank is a decision on all of them, not a hang.
    failures: list[object] = [None] * len(facts)
    dist.all_gather_object(failures, failure, group=group)
    _remove_own(facts[rank])
    failed = [f"rank {r}: {f}" for r, f in enumerate(failures) if f is not None]
    if failed:
        if transport == "shm":
            raise ValueError(
                f"host_transport='shm' is not possible for group {group_name(group)}: could "
                f"not map the mailboxes ({'; '.join(failed)}); pass host_transport='auto' or "
                "'gloo'"
            )
        return None
    made = SharedMemoryTransport(group, boxes, rank, chunk_bytes=slot_bytes, timeout_s=timeout_s)
    with _registry_lock:
        _transports[group] = made
    return made


def _map_all(
    facts: list[_HostFacts], rank: int, slot_bytes: int
) -> tuple[list[_Mailbox], str | None]:
    boxes: list[_Mailbox] = []
    for peer, fact in enumerate(facts):
        assert fact.path is not None
        if peer == rank:
            boxes.append(_OWN_BOXES[fact.path])
            continue
        try:
            boxes.append(_Mailbox(fact.path, slot_bytes, create=False))
        except OSError as exc:
            return [], f"{fact.path}: {exc.strerror}"
    return boxes, None


def _gather_facts(group: dist.ProcessGroup, slot_bytes: int) -> list[_HostFacts]:
    directory = _shm_dir()
    path: str | None = None
    if directory is not None:
        path = os.path.join(directory, f"mfsdp-{os.getpid()}-{uuid.uuid4().hex}")
        try:
            _OWN_BOXES[path] = _Mailbox(path, slot_bytes, create=True)
        except OSError:
            path = None
    mine = _HostFacts(
        host=f"{socket.gethostname()}/{_boot_id()}",
        arch_ok=platform.machine().lower() in _X86_64
        and platform.system() == "Linux"
        and _futex.available(),
        path=path,
    )
    facts: list[object] = [None] * dist.get_world_size(group)
    dist.all_gather_object(facts, mine, group=group)
    return [f for f in facts if isinstance(f, _HostFacts)]


def _unsuitable(facts: list[_HostFacts]) -> str | None:
    if len({f.host for f in facts}) > 1:
        return "its ranks run on more than one host"
    if not all(f.arch_ok for f in facts):
        return "the shared-memory protocol needs Linux on x86-64 CPUs (store order, futex)"
    if any(f.path is None for f in facts):
        return "a rank could not create its mailbox in /dev/shm or the temp directory"
    return None


def _remove_own(fact: _HostFacts) -> None:
    if fact.path is None:
        return
    _OWN_BOXES.pop(fact.path, None)
    with contextlib.suppress(FileNotFoundError):
        os.unlink(fact.path)
