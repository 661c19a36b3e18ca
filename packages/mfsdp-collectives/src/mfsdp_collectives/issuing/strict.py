"""Strict asynchronous collectives: a debug mode in which a missing wait cannot stay silent.

On a GPU a collective on a side stream writes its output some time after it is issued; a
consumer that forgets to wait reads stale or half-written data, and the only symptom is a
drift in convergence. On CPU with gloo the background thread is usually done before anyone
looks, so the same bug never shows. Inside ``strict_async()`` every asynchronous op of this
layer instead:

1. at launch, snapshots its inputs and its outputs' current contents, then fills the
   outputs with the poison pattern (NaN; the dtype's max for integers) and issues nothing;
2. at ``wait()`` (never at ``is_completed()``, which stays False), checks that nobody wrote
   the outputs meanwhile (a buffer reused before its collective finished) and that the
   inputs still hold what they held at launch (an input overwritten while in flight), and
   raises naming the collective if either happened; otherwise it restores the outputs
   (accumulating ops add to what was there), runs the real collective and its
   post-processing.

So a read before the wait sees NaN, which reaches the loss. The collectives run in wait
order, which is the same on every rank because every rank runs the same program. Buffers
the engine gives back to an allocator are poisoned too
(``mfsdp_buffers.poisoning_released_buffers``), so a read after release turns into NaN as
well. Host path only (CPU, or accelerators without side streams): on side streams the
stream simulator (``mfsdp_collectives.testing.stream_sim``) checks the ordering instead.
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
    """What ``deferred_handle`` runs when its handle is waited (see the module docstring)."""

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
