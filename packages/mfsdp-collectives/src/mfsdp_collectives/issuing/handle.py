"""The handle every collective in this layer returns. "The bytes arrived" and "the result is
ready" are one event: a bf16 gradient reduced in fp32 is not done until scaled, cast back and
accumulated, so ``wait()`` runs the post-processing too, then drops what kept the tensors
alive. A wait that fails because a peer died raises ``PeerDiedError`` naming it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from ..core._compat import Work
from ..safety.liveness import naming_dead_peers
from .streams import current_stream

__all__ = ["CommHandle"]


class CommHandle:
    """Completion of one (possibly multi-stage) collective, post-processing included: the
    works to wait for, a host-side ``finish`` (local, never a collective, so it may run
    whenever the works are done) and on accelerators the side stream's ``event``. ``wait()``
    is idempotent."""

    def __init__(
        self,
        works: Sequence[Work | None] = (),
        *,
        finish: Callable[[], None] | None = None,
        event: torch.Event | None = None,
        device: torch.device | None = None,
        keep_alive: Sequence[object] = (),
        label: str = "a collective",
        only_wait_completes: bool = False,
    ) -> None:
        self._label = label
        # A strict-mode handle (``strict.deferred_handle``) runs its collective in ``finish``:
        # only ``wait()`` may do that, never a poll.
        self._only_wait_completes = only_wait_completes
        self._works: list[Work] = [w for w in works if w is not None]
        self._finish = finish
        self._event = event
        self._device = device
        # Tensors used on a side stream (the caller's, and temporaries owned by
        # the op's stages) must outlive the work queued there: the handle holds
        # them until the consumer's stream has waited for it, which also orders
        # any later reuse of their memory after that work.
        self._keep_alive: tuple[object, ...] = tuple(keep_alive)
        self._done = False

    @classmethod
    def completed(cls) -> CommHandle:
        """A handle for an op that already finished (``async_op=False``)."""
        handle = cls()
        handle._done = True
        return handle

    def wait(self) -> None:
        """Block (CPU) or make the current stream wait (accelerator) until the result is ready."""
        if self._done:
            return
        with naming_dead_peers(self._label):
            for work in self._works:
                work.wait()
        if self._event is not None:
            assert self._device is not None
            current_stream(self._device).wait_event(self._event)
        self._complete()

    def is_completed(self) -> bool:
        """Whether the result is ready; finishes the host-side post-processing if so."""
        if self._done:
            return True
        if self._only_wait_completes:
            return False
        if not all(work.is_completed() for work in self._works):
            return False
        if self._event is not None and not self._event.query():
            return False
        self._complete()
        return True

    def _complete(self) -> None:
        finish, self._finish = self._finish, None
        if finish is not None:
            finish()
        self._works = []
        self._event = None
        self._keep_alive = ()
        self._done = True

    def __repr__(self) -> str:
        return f"CommHandle(done={self._done}, pending_works={len(self._works)})"
