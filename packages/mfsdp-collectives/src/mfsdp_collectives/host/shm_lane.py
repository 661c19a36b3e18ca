"""One lane of the shared-memory transport: an ordered stream of collectives with its own
mailbox region on every rank, its own step counter and its own worker thread.

The protocol (``shm`` explains the transport): each rank's region of a lane is a control
word and two slots of ``slot_bytes``. A collective is cut into steps of at most one slot; in
step ``k`` every rank writes its contribution into slot ``k % 2``, publishes ``k`` in its
control word, waits until every peer has published ``k``, then reads the peers' slots. A peer
that has published ``k`` has finished reading step ``k - 1``, so the slot written at step
``k + 1`` is free: one wait per step, no second barrier. Waiting is a futex sleep on the
peer's control word, which the peer wakes when it publishes.

Lanes are independent: every rank issues each lane's collectives in the same order, so two
lanes (the transport's all-gathers and its reduce-scatters) run at the same time without
ever waiting on each other.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import queue
import threading
import time
from collections.abc import Callable, Sequence

import torch

from mfsdp_buffers import FlatPieces

from . import _futex
from .collective_worker import Job, serve

__all__ = ["ALIGN", "CONTROL_BYTES", "Lane", "LaneBox", "MailboxFile", "PeerWatch"]

CONTROL_BYTES = 64  # one cache line: the published step counter
ALIGN = 64
_STEP_MASK = 0x7FFFFFFF
_HALF_RANGE = 1 << 30
# A waiting rank looks at its peers' processes this often: a dead peer is named within it.
LIVENESS_PERIOD_S = 0.5


class LaneBox:
    """One lane's region of a rank's mailbox file: the control word and two slots."""

    def __init__(self, mapping: mmap.mmap, offset: int, slot_bytes: int) -> None:
        # The published step, modulo 2**31, as a futex word peers can sleep on.
        self.control = ctypes.c_int32.from_buffer(mapping, offset)
        # frombuffer issues no aten op, so tensor-tracking dispatch modes (memory tests,
        # benchmarks) do not see the mapping: its bytes are reported by ``mapped_bytes``.
        self.slots = tuple(
            torch.frombuffer(mapping, dtype=torch.uint8, count=slot_bytes, offset=at)
            for at in (offset + CONTROL_BYTES, offset + CONTROL_BYTES + slot_bytes)
        )


class MailboxFile:
    """A rank's mapped mailbox file: one region (``LaneBox``) per lane."""

    def __init__(self, path: str, slot_bytes: int, lanes: int, *, create: bool) -> None:
        region = CONTROL_BYTES + 2 * slot_bytes
        flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0)
        fd = os.open(path, flags, 0o600)
        try:
            if create:
                os.ftruncate(fd, lanes * region)
            self._map = mmap.mmap(fd, lanes * region)
        finally:
            os.close(fd)
        self.lanes = [LaneBox(self._map, lane * region, slot_bytes) for lane in range(lanes)]


class PeerWatch:
    """What a waiting lane needs to know about the transport: how long to wait, and a check
    that raises ``PeerDiedError`` when a peer's process is gone."""

    def __init__(self, group: str, timeout_s: float, check_peers: Callable[[], None]) -> None:
        self.group, self.timeout_s, self.check_peers = group, timeout_s, check_peers


class Lane:
    """Collectives of one kind, in issue order, on this lane's worker thread."""

    def __init__(
        self, name: str, boxes: list[LaneBox], rank: int, slot_bytes: int, watch: PeerWatch
    ) -> None:
        self.rank, self.size, self.slot_bytes = rank, len(boxes), slot_bytes
        self._boxes, self._own, self._step, self._watch = boxes, boxes[rank], 0, watch
        self.jobs: queue.SimpleQueue[Job | None] = queue.SimpleQueue()
        # A daemon thread: a rank that exits with a collective still waiting for its peers
        # must not be held at interpreter exit.
        self.worker = threading.Thread(target=serve, args=(self.jobs,), name=name, daemon=True)
        self.worker.start()

    def stop(self, timeout_s: float = 1.0) -> None:
        """Finish the queued collectives and stop the worker (a stuck one stays a daemon)."""
        self.jobs.put(None)
        self.worker.join(timeout=timeout_s)

    def _elements_per_step(self, dtype: torch.dtype, pieces: int) -> int:
        per_piece = (self.slot_bytes // max(pieces, 1)) // ALIGN * ALIGN
        return max(per_piece // dtype.itemsize, 1)

    def _slot(self, box: LaneBox, dtype: torch.dtype) -> torch.Tensor:
        return box.slots[self._step % 2].view(dtype)

    def _exchange(self) -> None:
        """Publish this step and wait until every peer has published it too."""
        step = self._step & _STEP_MASK
        self._own.control.value = step
        _futex.wake(self._own.control)
        watch = self._watch
        start = time.monotonic()
        deadline, next_check = start + watch.timeout_s, start + LIVENESS_PERIOD_S
        for peer, box in enumerate(self._boxes):
            while True:
                seen = box.control.value
                if (seen - step) & _STEP_MASK < _HALF_RANGE:  # seen >= step, modulo 2**31
                    break
                now = time.monotonic()
                if now >= next_check:
                    watch.check_peers()
                    next_check = now + LIVENESS_PERIOD_S
                if now >= deadline:
                    raise TimeoutError(
                        f"shared-memory collective on group {watch.group} waited "
                        f"{watch.timeout_s:.0f}s for rank {peer} at step {step}: a rank "
                        "stopped issuing collectives (it hangs, or the ranks issued different "
                        "collectives in a different order)"
                    )
                _futex.wait(box.control, seen, min(deadline, next_check) - now)

    def all_gather_many(self, outputs: list[torch.Tensor], shards: list[torch.Tensor]) -> None:
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

    def reduce_scatter(
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


def src_index(dst: int, src: int) -> int:
    """Position of ``dst``'s piece in ``src``'s slot (``src`` skips itself)."""
    return dst if dst < src else dst - 1
