"""Run a collective's stages on the right stream and wrap them in a ``CommHandle``.

A collective is one or more *stages* (HSDP: reduce-scatter, then the outer all-reduce), each
issuing async work the next depends on, plus a local ``finish`` (scale, cast back,
accumulate). With active side streams each stage runs on its own, ordered by
``wait_stream``; otherwise they are issued in order on the host, each waiting for the
previous. The next stage is issued at once, never lazily from a callback: that keeps the
order of collectives identical on every rank, which prevents mismatched-collective hangs.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from ..core._compat import Work
from ..safety.liveness import naming_dead_peers
from .handle import CommHandle
from .streams import current_stream, stream_backend
from .strict import deferred_handle, strict_async_enabled

__all__ = ["Stage", "issue_stages"]

Stage = tuple[torch.Stream | None, Callable[[], Work | None]]


def issue_stages(
    stages: Sequence[Stage],
    *,
    device: torch.device,
    finish: Callable[[], None] | None,
    async_op: bool,
    keep_alive: Sequence[object],
    label: str,
    reads: Sequence[torch.Tensor] = (),
    writes: Sequence[torch.Tensor] = (),
) -> CommHandle:
    """Issue ``stages`` in order and return a handle that completes them and ``finish``.

    ``label`` names the collective in a dead peer's error; ``reads`` and ``writes``, the
    caller's tensors it touches, are what strict mode and the stream simulator check."""
    with naming_dead_peers(label):
        if stages and all(stream is not None for stream, _ in stages):
            handle = _issue_on_side_streams(
                stages,
                device=device,
                finish=finish,
                keep_alive=keep_alive,
                label=label,
                accesses=(reads, writes),
            )
        elif async_op and strict_async_enabled():
            issues = [issue for _, issue in stages]
            handle = deferred_handle(
                issues,
                finish=finish,
                reads=reads,
                writes=writes,
                keep_alive=keep_alive,
                label=label,
            )
        else:
            handle = _issue_on_host(stages, finish=finish, keep_alive=keep_alive, label=label)
    if not async_op:
        handle.wait()
    return handle


def _issue_on_side_streams(
    stages: Sequence[Stage],
    *,
    device: torch.device,
    finish: Callable[[], None] | None,
    keep_alive: Sequence[object],
    label: str,
    accesses: tuple[Sequence[torch.Tensor], Sequence[torch.Tensor]],
) -> CommHandle:
    """``accesses``: the caller's tensors the collective reads and writes, declared to the
    stream backend (a simulator checks them; torch's streams need nothing)."""
    reads, writes = accesses
    backend = stream_backend()
    prev = current_stream(device)
    last = prev
    for index, (stream, issue) in enumerate(stages):
        assert stream is not None
        # Without this the side stream may read inputs compute has not finished writing.
        stream.wait_stream(prev)
        if index == 0:  # the first stage reads the caller's inputs
            backend.note_collective(stream, reads, ())
        with stream:
            work = issue()
            if work is not None:
                backend.wait_work(work)  # the side stream (not the host) waits for it
        prev = last = stream
    if finish is not None:
        with last:
            finish()
    backend.note_collective(last, (), writes)
    event = last.record_event()
    # The stages and finish own the temporaries (cast copies, receive buffers)
    # that later streams still use; free them only after the handle is waited.
    owners = (*keep_alive, *stages, finish)
    return CommHandle(event=event, device=device, keep_alive=owners, label=label)


def _issue_on_host(
    stages: Sequence[Stage],
    *,
    finish: Callable[[], None] | None,
    keep_alive: Sequence[object],
    label: str,
) -> CommHandle:
    pending: Work | None = None
    for _, issue in stages:
        if pending is not None:
            pending.wait()
        pending = issue()
    return CommHandle((pending,), finish=finish, keep_alive=keep_alive, label=label)
