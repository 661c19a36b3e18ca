"""Trace one iteration's allocate/free sequence, plan a static pool, replay it afterwards.

Training iterations repeat the same gathers and frees in the same order; how the pool is
planned and replayed: the package README, "Allocators". Safety over speed: a request that
does not match the trace (key, size, dtype, device, position) is served by ``torch.empty``,
and so is every later one of that iteration; so is a matching request whose planned bytes
overlap a pooled tensor still live. Pool bytes are therefore never handed out while another
live tensor uses them. Frees may arrive in any order.
"""

from __future__ import annotations

import enum
from collections.abc import Hashable
from dataclasses import dataclass
from typing import ClassVar

import torch

from mfsdp_buffers.allocators.interval_plan import Interval, PoolPlan, plan_offsets
from mfsdp_buffers.allocators.protocol import check_request

_PoolKey = tuple[torch.dtype, torch.device]


class TracePhase(enum.Enum):
    """What the allocator does with the current iteration's requests."""

    WARMUP = "warmup"
    """Serve with ``torch.empty`` and record nothing (first iterations may differ)."""
    TRACE = "trace"
    """Serve with ``torch.empty`` and record the request sequence and lifetimes."""
    REPLAY = "replay"
    """Serve from the planned pool while requests match the trace."""


@dataclass(frozen=True)
class _Request:
    key: Hashable
    numel: int
    dtype: torch.dtype
    device: torch.device


@dataclass(frozen=True)
class _Slot:
    """Planned place of one traced request: ``[offset, offset + numel)`` in pool ``pool``."""

    pool: _PoolKey
    offset: int
    numel: int


@dataclass
class _Live:
    key: Hashable
    tensor: torch.Tensor
    seq: int
    iteration: int
    slot: _Slot | None
    """Pool bytes this tensor occupies; None when it came from ``torch.empty``."""


class TracePoolAllocator:
    """Pooled allocator planned from a traced iteration; see the module docstring.

    Args:
        alignment: every planned offset is a multiple of this many elements.
        warmup_iterations: iterations served by ``torch.empty`` before the trace,
            for engines whose first iteration differs (e.g. it records the
            execution order and does not prefetch yet).
        retrace_after: if set, this many consecutive iterations that diverged
            from the trace make the next iteration a new trace (the schedule
            changed for good). ``None`` keeps the first plan forever.
    """

    stable_storage: ClassVar[bool] = False

    def __init__(
        self,
        *,
        alignment: int = 1,
        warmup_iterations: int = 0,
        retrace_after: int | None = None,
    ) -> None:
        if alignment < 1:
            raise ValueError(f"alignment must be >= 1, got {alignment}")
        if warmup_iterations < 0:
            raise ValueError(f"warmup_iterations must be >= 0, got {warmup_iterations}")
        if retrace_after is not None and retrace_after < 1:
            raise ValueError(f"retrace_after must be >= 1 or None, got {retrace_after}")
        self.alignment = alignment
        self.retrace_after = retrace_after
        self._warmup_left = warmup_iterations
        self.iteration = 0
        """Number of completed iterations (calls to :meth:`end_iteration`)."""
        self.fallbacks = 0
        """Requests served by ``torch.empty`` in REPLAY that the plan meant to serve."""
        self._live: dict[int, _Live] = {}
        self._pools: dict[_PoolKey, torch.Tensor] = {}
        self._plans: dict[_PoolKey, PoolPlan] = {}
        self._trace: list[_Request] = []
        self._alloc_time: list[int] = []
        self._free_time: list[int | None] = []
        self._clock = 0
        self._slots: list[_Slot | None] = []
        self.phase = TracePhase.WARMUP if warmup_iterations else TracePhase.TRACE
        self._seq = 0
        """Requests made so far in the current iteration."""
        self._armed = True
        """False between a mid-iteration plan() and the next iteration start."""
        self._matching = True
        """Whether the current iteration still follows the trace."""
        self._diverged_streak = 0

    # -------------------------------------------------------------- protocol

    def allocate(
        self, key: Hashable, numel: int, dtype: torch.dtype, device: torch.device
    ) -> torch.Tensor:
        check_request(numel, dtype, device)
        request = _Request(key, numel, dtype, device)
        seq = self._seq
        self._seq += 1
        slot: _Slot | None = None
        if self.phase is TracePhase.TRACE:
            self._trace.append(request)
            self._alloc_time.append(self._clock)
            self._free_time.append(None)
            self._clock += 1
        elif self.phase is TracePhase.REPLAY:
            slot = self._replay_slot(seq, request)
        tensor = (
            torch.empty(numel, dtype=dtype, device=device)
            if slot is None
            else self._pool(slot.pool)[slot.offset : slot.offset + slot.numel]
        )
        self._live[id(tensor)] = _Live(key, tensor, seq, self.iteration, slot)
        return tensor

    def free(self, key: Hashable, tensor: torch.Tensor) -> None:
        record = self._live.get(id(tensor))
        if record is None or record.tensor is not tensor:
            raise RuntimeError(f"free({key!r}): tensor was not allocated by this allocator")
        if record.key != key:
            raise RuntimeError(f"free({key!r}): tensor was allocated under key {record.key!r}")
        del self._live[id(tensor)]
        if self.phase is TracePhase.TRACE and record.iteration == self.iteration:
            self._free_time[record.seq] = self._clock
            self._clock += 1

    # -------------------------------------------------------------- lifecycle

    def plan(self) -> None:
        """Build the pools from the trace recorded so far and switch to REPLAY.

        Requests traced but not freed before this call are left out of the pool
        (they outlive the iteration, so their bytes could not be reused next
        time); replay serves them with ``torch.empty``. Requests made after this
        call and before the next :meth:`end_iteration` are served with
        ``torch.empty``: replay starts in step with the trace, at an iteration start.
        """
        if self.phase is not TracePhase.TRACE:
            raise RuntimeError(f"plan() needs the TRACE phase, allocator is in {self.phase.name}")
        # dicts keep insertion order: pools and intervals are in trace order, deterministic.
        by_pool: dict[_PoolKey, list[tuple[int, Interval]]] = {}
        for seq, (request, start, end) in enumerate(
            zip(self._trace, self._alloc_time, self._free_time, strict=True)
        ):
            if end is not None:
                interval = Interval(start, end, request.numel)
                by_pool.setdefault((request.dtype, request.device), []).append((seq, interval))
        self._slots = [None] * len(self._trace)
        self._plans = {}
        self._pools = {}
        for pool_key, entries in by_pool.items():
            pool_plan = plan_offsets([iv for _, iv in entries], self.alignment)
            self._plans[pool_key] = pool_plan
            for (seq, iv), offset in zip(entries, pool_plan.offsets, strict=True):
                self._slots[seq] = _Slot(pool_key, offset, iv.numel)
        self.phase = TracePhase.REPLAY
        self._armed = False

    def end_iteration(self) -> None:
        """Close the current iteration: plan after the trace, resynchronise after a replay."""
        retrace = False
        if self.phase is TracePhase.TRACE:
            self.plan()
        elif self.phase is TracePhase.REPLAY:
            if self._armed:
                self._diverged_streak = 0 if self._matching else self._diverged_streak + 1
            retrace = self.retrace_after is not None and self._diverged_streak >= self.retrace_after
        else:
            self._warmup_left -= 1
            if self._warmup_left <= 0:
                self.phase = TracePhase.TRACE
        self.iteration += 1
        self._seq = 0
        self._armed = True
        self._matching = True
        if retrace:
            self.reset()

    def reset(self) -> None:
        """Forget the plan and trace again, from the next iteration start.

        Called between iterations, the next iteration is the trace; called in the
        middle of one, the rest of it is served by ``torch.empty`` and the one
        after is traced. Tensors still live keep their old pool memory alive
        through their views and new pools are separate storage, so this is safe
        at any time.
        """
        self._trace = []
        self._alloc_time = []
        self._free_time = []
        self._clock = 0
        self._slots = []
        self._plans = {}
        self._pools = {}
        self._diverged_streak = 0
        if self._seq == 0:
            self.phase = TracePhase.TRACE
        else:
            self.phase = TracePhase.WARMUP
            self._warmup_left = 1

    # ------------------------------------------------------------ statistics

    def pool_numel(self, dtype: torch.dtype, device: torch.device) -> int:
        """Planned pool size for ``(dtype, device)`` in elements (0 when nothing is planned)."""
        plan = self._plans.get((dtype, device))
        return 0 if plan is None else plan.pool_numel

    def peak_numel(self, dtype: torch.dtype, device: torch.device) -> int:
        """Peak of simultaneously live traced elements for ``(dtype, device)``: the lower bound."""
        plan = self._plans.get((dtype, device))
        return 0 if plan is None else plan.peak_numel

    @property
    def naive_numel(self) -> int:
        """Sum of all traced request sizes: what allocating each request separately would hold."""
        return sum(r.numel for r in self._trace)

    @property
    def planned_peak(self) -> int:
        """Sum over pools of the traced peak of live elements (what an ideal plan needs)."""
        return sum(p.peak_numel for p in self._plans.values())

    @property
    def planned_pool_numel(self) -> int:
        """Sum over pools of the planned pool sizes (``>= planned_peak``)."""
        return sum(p.pool_numel for p in self._plans.values())

    @property
    def diverged(self) -> bool:
        """Whether the current REPLAY iteration has left the trace."""
        return self.phase is TracePhase.REPLAY and not self._matching

    def pool(self, dtype: torch.dtype, device: torch.device) -> torch.Tensor | None:
        """The pool storage for ``(dtype, device)`` once replay has created it, else None."""
        return self._pools.get((dtype, device))

    # --------------------------------------------------------------- helpers

    def _replay_slot(self, seq: int, request: _Request) -> _Slot | None:
        """Planned slot for this request, or None to serve it with ``torch.empty``."""
        if not self._armed:
            return None
        if self._matching and (seq >= len(self._trace) or self._trace[seq] != request):
            self._matching = False
        if not self._matching:
            self.fallbacks += 1
            return None
        slot = self._slots[seq]
        if slot is None:
            return None  # outlived the traced iteration: never pooled
        if any(
            live.slot is not None
            and live.slot.pool == slot.pool
            and live.slot.offset < slot.offset + slot.numel
            and slot.offset < live.slot.offset + live.slot.numel
            for live in self._live.values()
        ):
            self.fallbacks += 1
            return None
        return slot

    def _pool(self, pool_key: _PoolKey) -> torch.Tensor:
        pool = self._pools.get(pool_key)
        if pool is None:
            dtype, device = pool_key
            pool = torch.empty(self._plans[pool_key].pool_numel, dtype=dtype, device=device)
            self._pools[pool_key] = pool
        return pool
