"""A background thread for the quantized collectives on CPU groups.

Gloo runs its own reduce-scatters and all-gathers on its worker threads while the training
thread computes; a quantized one also has to quantize before and sum (or dequantize) after
its exchange, and done on the training thread that work sits on the critical path.
``CollectiveWorker`` takes the whole of it (quantize, exchange, sum) off that thread;
``wait()`` on the returned ``BackgroundWork`` re-raises whatever the job raised (a
``NonFiniteError`` raises on every rank alike).

Why a private group per group: c10d pairs a group's collectives by the order in which ranks
issue them. The training thread goes on issuing its own (the next all-gathers) on the same
group while a job runs, so the worker exchanges over a clone of the group, made for it once,
by the members only (``use_local_synchronization``), on the training thread at the first
job: every member reaches that point of the program in the same order. Jobs run one at a
time in the order they were submitted, which is the same on every rank.

A peer that dies closes its sockets, so the exchange in the job raises and ``wait()`` with
it; nothing waits on a dead rank for a timeout.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future

import torch.distributed as dist

from ..core.naming import group_name, register_group_name
from ..safety.liveness import call_watching_peers

__all__ = ["BackgroundWork", "CollectiveWorker"]

_Job = tuple["Future[None]", Callable[[], None]]


class BackgroundWork:
    """The ``Work`` of one job: done when the job has run; ``wait()`` re-raises its error.
    A failed job never polls as completed: its error surfaces at ``wait()``, a point every
    rank reaches, not at a poll, which lands at different moments on different ranks."""

    def __init__(self, future: Future[None]) -> None:
        self._future = future

    def wait(self) -> bool:
        self._future.result()
        return True

    def is_completed(self) -> bool:
        return self._future.done() and self._future.exception() is None


class CollectiveWorker:
    """One daemon thread that runs submitted jobs in order, and the private clones of the
    groups they exchange over (module docstring). Thread-safe to submit from one thread."""

    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue[_Job] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._clones: dict[tuple[int, ...], dist.ProcessGroup] = {}

    def clone(self, group: dist.ProcessGroup) -> dist.ProcessGroup:
        """The worker's own group over ``group``'s ranks (collective over them at first use;
        call it on the submitting thread, at the same point of the program on every rank)."""
        ranks = tuple(dist.get_process_group_ranks(group))
        clone = self._clones.get(ranks)
        if clone is None:
            made = call_watching_peers(
                lambda: dist.new_group(list(ranks), use_local_synchronization=True),
                ranks,
                f"creating the quantized collectives' own group over {group_name(group)}",
            )
            assert made is not None, "a member of the group got no clone of it"
            register_group_name(made, f"{group_name(group)}.quantized")
            clone = self._clones[ranks] = made
        return clone

    def submit(self, job: Callable[[], None]) -> BackgroundWork:
        """Run ``job`` after every job submitted before it."""
        if self._thread is None:
            self._thread = threading.Thread(
                target=self._run, name="mfsdp-quantized-collectives", daemon=True
            )
            self._thread.start()
        future: Future[None] = Future()
        self._jobs.put((future, job))
        return BackgroundWork(future)

    def _run(self) -> None:
        while True:
            future, job = self._jobs.get()
            if not future.set_running_or_notify_cancel():
                continue
            try:
                job()
            except BaseException as error:  # handed to wait(), on the training thread
                future.set_exception(error)
            else:
                future.set_result(None)
