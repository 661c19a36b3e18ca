"""Strict asynchronous collectives: a debug mode in which a missing wait cannot stay silent
(the package README's "Strict asynchronous collectives" says what each op does under it).

On a GPU a consumer that forgets to wait reads stale or half-written data, and the only
symptom is a drift in convergence; on CPU gloo's thread is usually done before anyone looks.
Here the outputs read NaN until the wait, which runs the collective; collectives run in wait
order, the same on every rank because every rank runs the same program. Host path only: the
stream simulator checks side streams.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence

import torch

from mfsdp_buffers import is_poisoned, poison_, poisoning_released_buffers

from ..core._compat import Work
from ..safety.liveness import naming_dead_peers
from .handle import CommHandle

__all__ = ["strict_async", "strict_async_enabled"]

_enabled: list[bool] = [False]  # flipped only by ``strict_async``


def strict_async_enabled() -> bool:
    return _enabled[0]


@contextlib.contextmanager
def strict_async(enabled: bool = True) -> Iterator[None]:
    """Run the block with deferred, poisoning collectives and poisoned released buffers."""
    previous, _enabled[0] = _enabled[0], bool(enabled)
    try:
        with poisoning_released_buffers(enabled):
            yield
    finally:
        _enabled[0] = previous


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The bytes of ``t``: NaN compares equal to itself, as a copy must."""
    return t.detach().reshape(-1).view(torch.uint8)


class _DeferredCollective:
    """What ``deferred_handle`` runs when its handle is waited: check, restore, issue."""

    def __init__(
        self,
        issues: Sequence[Callable[[], Work | None]],
        finish: Callable[[], None] | None,
        reads: Sequence[torch.Tensor],
        writes: Sequence[torch.Tensor],
        label: str,
    ) -> None:
        self._issues = list(issues)
        self._finish = finish
        self._label = label
        self._reads = [(t, _bits(t).clone()) for t in reads]
        self._writes = [(t, t.detach().clone()) for t in writes]
        for t in writes:
            poison_(t.detach())

    def __call__(self) -> None:
        for tensor, _ in self._writes:
            if not is_poisoned(tensor):
                raise RuntimeError(
                    f"strict_async: the output of {self._label} was written before its handle "
                    "was waited: a buffer reused while its collective was still in flight"
                )
        with torch.no_grad():
            for tensor, before in self._writes:
                tensor.copy_(before)
        for tensor, snapshot in self._reads:
            if not torch.equal(_bits(tensor), snapshot):
                raise RuntimeError(
                    f"strict_async: an input of {self._label} changed between launch and "
                    "wait: it was overwritten while the collective could still be reading it"
                )
        with naming_dead_peers(self._label):
            for issue in self._issues:
                work = issue()
                if work is not None:
                    work.wait()
        if self._finish is not None:
            self._finish()


def deferred_handle(
    issues: Sequence[Callable[[], Work | None]],
    *,
    finish: Callable[[], None] | None,
    reads: Sequence[torch.Tensor],
    writes: Sequence[torch.Tensor],
    keep_alive: Sequence[object],
    label: str,
) -> CommHandle:
    """A handle whose collective runs, checked, only when it is waited."""
    run = _DeferredCollective(issues, finish, reads, writes, label)
    return CommHandle(finish=run, keep_alive=keep_alive, label=label, only_wait_completes=True)
