"""Communication accounting: how many collectives, and how many bytes, per group. A
regression that gathers a bucket twice or reduces in fp32 by accident is invisible in loss
curves but obvious in a byte count. Tracers are process-wide, not thread-local: autograd may
run backward hooks (and their reduce-scatters) on another thread than the one that opened it.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from types import TracebackType

import torch

__all__ = ["OP_NAMES", "CommLog", "CommRecord", "CommTracer", "record_comm"]

# "grad_presence": the all-reduce of one flag per parameter that settles which parameters got
# a gradient on some rank (mfsdp_hooks' grad_presence), counted apart from the gradient
# all-reduces, which FSDP2 issues as well. "all_to_all": what a whole-matrix optimizer step
# exchanges (``exchange.all_to_all_into``), what this rank sends.
OP_NAMES = (
    "all_gather",
    "reduce_scatter",
    "all_reduce",
    "broadcast",
    "grad_presence",
    "all_to_all",
)

_active_lock = threading.Lock()
_active: list[CommTracer] = []


@dataclass(frozen=True)
class CommRecord:
    """One collective as seen by this rank; ``bytes`` is what this rank sends in."""

    op: str
    group: str
    numel: int
    dtype: torch.dtype
    bytes: int


def record_comm(op: str, group: str, numel: int, dtype: torch.dtype) -> None:
    """Report one collective to every open tracer (cheap when none is open)."""
    if not _active:
        return
    rec = CommRecord(op=op, group=group, numel=numel, dtype=dtype, bytes=numel * dtype.itemsize)
    with _active_lock:
        tracers = list(_active)
    for tracer in tracers:
        tracer._add(rec)


class CommLog:
    """Collectives recorded in issue order, and the totals tests assert on."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._records: list[CommRecord] = []

    def _add(self, rec: CommRecord) -> None:
        with self._lock:
            self._records.append(rec)

    @property
    def records(self) -> list[CommRecord]:
        """Every collective in issue order (a copy)."""
        with self._lock:
            return list(self._records)

    def _select(self, op: str, group: str | None) -> list[CommRecord]:
        if op not in OP_NAMES:
            raise ValueError(f"op={op!r} is not a traced op; use one of {list(OP_NAMES)}")
        return [r for r in self.records if r.op == op and (group is None or r.group == group)]

    def calls(self, op: str, group: str | None = None) -> int:
        """Number of ``op`` collectives (on ``group`` only, when given)."""
        return len(self._select(op, group))

    def bytes(self, op: str, group: str | None = None) -> int:
        """Bytes this rank sent into ``op`` collectives (on ``group`` only, when given)."""
        return sum(r.bytes for r in self._select(op, group))

    def summary(self) -> dict[str, dict[str, int]]:
        """``{"<group>/<op>": {"calls": n, "bytes": b}}`` in first-issue order."""
        out: dict[str, dict[str, int]] = {}
        for r in self.records:
            entry = out.setdefault(f"{r.group}/{r.op}", {"calls": 0, "bytes": 0})
            entry["calls"] += 1
            entry["bytes"] += r.bytes
        return out

    def reset(self) -> None:
        """Forget everything recorded so far (the log stays open)."""
        with self._lock:
            self._records.clear()


class CommTracer(CommLog):
    """Counts calls and bytes per ``(group, op)`` of this package's collectives while open;
    nested tracers each record everything, and one entered twice counts once."""

    def __init__(self) -> None:
        super().__init__()
        self._depth = 0

    def __enter__(self) -> CommTracer:
        with _active_lock:
            if self._depth == 0:
                _active.append(self)
            self._depth += 1
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        with _active_lock:
            self._depth -= 1
            if self._depth == 0:
                _active.remove(self)
