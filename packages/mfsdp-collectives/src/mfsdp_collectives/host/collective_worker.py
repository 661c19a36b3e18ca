"""A background thread for the quantized collectives on CPU groups: quantizing and summing
on the training thread would sit on the critical path, so ``CollectiveWorker`` takes the whole
job (quantize, exchange, sum) off it; ``BackgroundWork.wait()`` re-raises what the job raised.

Why a private group: c10d pairs a group's collectives by issue order, and the training thread
goes on issuing on the same group while a job runs. So the worker exchanges over a clone, made
once by the members only (``use_local_synchronization``), on the training thread at the first
job, which every member reaches in the same order. Jobs run one at a time in submission order.
A dead peer closes its sockets, so the job's exchange raises, and ``wait()`` with it: no timeout.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future

import torch.distributed as dist

from ..core.naming import group_name, register_group_name
from ..safety.liveness import call_watching_peers

__all__ = ["BackgroundWork", "CollectiveWorker", "Job", "serve"]

Job = tuple["Future[None]", Callable[[], None]]


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
    groups they exchange over."""

    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue[Job | None] = queue.SimpleQueue()
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
                target=serve, args=(self._jobs,), name="mfsdp-quantized-collectives", daemon=True
            )
            self._thread.start()
        future: Future[None] = Future()
        self._jobs.put((future, job))
        return BackgroundWork(future)


def serve(jobs: queue.SimpleQueue[Job | None]) -> None:
    """A worker thread's loop: run each job in submission order, completing its future (an
    error is handed to ``wait()``, on the waiting thread), until a ``None``."""
    while (item := jobs.get()) is not None:
        future, job = item
        if future.set_running_or_notify_cancel():
            try:
                job()
            except BaseException as error:
                future.set_exception(error)
            else:
                future.set_result(None)
        # Drop the job before blocking on the next one: it holds the collective's tensors.
        del future, job, item
