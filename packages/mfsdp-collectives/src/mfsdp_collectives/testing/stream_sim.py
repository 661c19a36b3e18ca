"""Simulated streams on CPU: the engine's stream code, checked for ordering bugs in CI (the
package README's "Simulated streams").

Work runs at once; the order a GPU would guarantee is simulated with vector clocks: every stream
counts its operations, and ``wait_stream``/``wait_event`` make a stream know what the other had
issued. Collectives declare what they read and write (``note_collective``): the bytes a backend
moves are no tensor op. For each storage the last write and the reads since are kept; a use not
ordered after another stream's earlier one raises ``StreamOrderError``. New storages count as
writes, so memory handed back while a side stream may use it raises when the allocator reuses
the address. Checking the order catches each missing edge at its first use, whatever the
timing; a lazy executor would only show it when its reordering changed the numbers.
``Tensor.record_stream`` has no stand-in: the engine keeps collective buffers alive through
``CommHandle`` instead.
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, cast

import torch
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from ..core._compat import Work
from ..issuing.streams import using_stream_backend

__all__ = ["SimEvent", "SimStream", "StreamOrderError", "StreamSimulator", "simulated_streams"]


class StreamOrderError(RuntimeError):
    """A buffer used on one stream before another stream's earlier use of it was waited."""


class SimEvent:
    """What a stream had issued when the event was recorded. ``query()`` is always False (a
    GPU may be that slow); ``synchronize()`` orders all later work after it."""

    def __init__(self, clock: dict[int, int], simulator: StreamSimulator | None = None) -> None:
        self.clock = dict(clock)
        self._simulator = simulator

    def query(self) -> bool:
        return False

    def synchronize(self) -> None:
        if self._simulator is not None:
            self._simulator.host_saw(self.clock)


class SimStream:
    """A stream stand-in: a vector clock, and the current stream inside ``with``."""

    def __init__(self, simulator: StreamSimulator, name: str) -> None:
        self._simulator = simulator
        self.name = name
        self.id = next(simulator.ids)
        self.tick = 0
        self.clock: dict[int, int] = {self.id: 0}

    def advance(self) -> int:
        self.tick += 1
        self.clock[self.id] = self.tick
        return self.tick

    def knows(self, stream_id: int, tick: int) -> bool:
        """Whether work issued on ``stream_id`` up to ``tick`` is ordered before this stream's."""
        return stream_id == self.id or self.clock.get(stream_id, 0) >= tick

    def merge(self, clock: dict[int, int]) -> None:
        for sid, tick in clock.items():
            if sid != self.id and tick > self.clock.get(sid, 0):
                self.clock[sid] = tick

    def wait_stream(self, other: SimStream) -> None:
        self.merge(other.clock)

    def wait_event(self, event: SimEvent) -> None:
        self.merge(event.clock)

    def record_event(self, event: SimEvent | None = None) -> SimEvent:
        self.advance()
        return SimEvent(self.clock, self._simulator)

    def synchronize(self) -> None:
        self._simulator.host_saw(self.clock)

    def query(self) -> bool:
        return False

    def __enter__(self) -> SimStream:
        self._simulator.stack.append(self)
        return self

    def __exit__(self, *exc: object) -> None:
        self._simulator.stack.pop()

    def __repr__(self) -> str:
        return f"SimStream({self.name!r})"


@dataclass
class _Use:
    """One storage's last write and the reads since: (stream, tick, what did it)."""

    write: tuple[SimStream, int, str] | None = None
    reads: dict[int, tuple[SimStream, int, str]] = field(default_factory=dict)


def _storages(value: Any) -> list[tuple[int, torch.Tensor]]:
    found = []
    for leaf in tree_flatten(value)[0]:
        if isinstance(leaf, DTensor):
            leaf = leaf.to_local()
        if isinstance(leaf, torch.Tensor) and leaf.device.type != "meta":
            storage = leaf.untyped_storage()
            if storage.nbytes() > 0:
                found.append((storage.data_ptr(), leaf))
    return found


class StreamSimulator:
    """The streams of one ``simulated_streams()`` block and the uses of every storage."""

    def __init__(self) -> None:
        self.ids = itertools.count()
        self.compute = SimStream(self, "compute")
        self.stack: list[SimStream] = []
        self.streams: list[SimStream] = [self.compute]
        self._uses: dict[int, _Use] = {}
        self.checked = 0  # accesses checked, so a test can tell the checker ran
        self._paused = 0

    # -- StreamBackend -------------------------------------------------------------------
    def provides_streams(self, device: torch.device) -> bool:
        return True

    def new_stream(self, device: torch.device, role: str) -> torch.Stream:
        stream = SimStream(self, role)
        self.streams.append(stream)
        return cast(torch.Stream, stream)

    def current_stream(self, device: torch.device | None = None) -> torch.Stream:
        return cast(torch.Stream, self.current)

    def note_collective(
        self, stream: torch.Stream, reads: Sequence[torch.Tensor], writes: Sequence[torch.Tensor]
    ) -> None:
        stream_ = cast(SimStream, stream)
        self.access(stream_, _storages(list(reads)), _storages(list(writes)), "a collective")

    def host_saw(self, clock: dict[int, int]) -> None:
        """The host waited for (or saw complete) work up to ``clock``: all later work, on
        every stream, is ordered after it."""
        for stream in self.streams:
            stream.merge(clock)

    def wait_work(self, work: Work) -> None:
        # The backend's completion (gloo copies its own buffers into the output here) is
        # not the engine's memory; the collective's reads and writes were declared.
        with self.paused():
            work.wait()

    @property
    def is_paused(self) -> bool:
        return self._paused > 0

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Stop checking tensor ops while the block runs."""
        self._paused += 1
        try:
            yield
        finally:
            self._paused -= 1

    # -- the check -----------------------------------------------------------------------
    @property
    def current(self) -> SimStream:
        return self.stack[-1] if self.stack else self.compute

    def access(
        self,
        stream: SimStream,
        reads: list[tuple[int, torch.Tensor]],
        writes: list[tuple[int, torch.Tensor]],
        what: str,
    ) -> None:
        """Check, then record, ``stream`` reading ``reads`` and writing ``writes`` (by
        ``what``: an op's name, or a collective)."""
        for key, tensor in reads:
            use = self._uses.get(key)
            if use is not None and use.write is not None:
                self._require(stream, use.write, "reads", tensor, what)
        for key, tensor in writes:
            use = self._uses.get(key)
            if use is not None:
                if use.write is not None:
                    self._require(stream, use.write, "writes", tensor, what)
                for earlier in use.reads.values():
                    self._require(stream, earlier, "writes", tensor, what)
        tick = stream.advance()
        for key, _ in reads:
            self._uses.setdefault(key, _Use()).reads[stream.id] = (stream, tick, what)
        for key, _ in writes:
            self._uses[key] = _Use(write=(stream, tick, what))
        self.checked += len(reads) + len(writes)

    def _require(
        self,
        stream: SimStream,
        earlier: tuple[SimStream, int, str],
        verb: str,
        tensor: torch.Tensor,
        what: str,
    ) -> None:
        other, tick, earlier_what = earlier
        if stream.knows(other.id, tick):
            return
        raise StreamOrderError(
            f"stream {stream.name!r} {verb} a buffer ({tuple(tensor.shape)} {tensor.dtype}; in "
            f"{what}) that stream {other.name!r} used earlier (in {earlier_what}) without "
            f"being ordered after that use: {stream.name}.wait_stream({other.name}) or a wait "
            f"on an event {other.name} recorded after it is missing (or the memory was handed "
            f"back while {other.name} could still use it)"
        )


class _AccessChecker(TorchDispatchMode):  # type: ignore[no-untyped-call]
    """Sees every tensor op and reports its reads and writes to the simulator."""

    def __init__(self, simulator: StreamSimulator) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self._simulator = simulator

    def __torch_dispatch__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        schema = func._schema
        reads: list[tuple[int, torch.Tensor]] = []
        writes: list[tuple[int, torch.Tensor]] = []
        for index, argument in enumerate(schema.arguments):
            value = args[index] if index < len(args) else kwargs.get(argument.name)
            written = argument.alias_info is not None and argument.alias_info.is_write
            (writes if written else reads).extend(_storages(value))
        is_view = any(r.alias_info is not None for r in schema.returns) and not writes
        out = func(*args, **kwargs)
        if (
            not is_view and not self._simulator.is_paused
        ):  # a view touches no data; a fresh output is a write of new memory
            fresh = [r.alias_info is None for r in schema.returns]
            outputs = out if isinstance(out, (tuple, list)) else (out,)
            new = [o for o, f in zip(outputs, fresh, strict=False) if f]
            current = self._simulator.current
            self._simulator.access(current, reads, writes + _storages(new), str(func))
        return out


@contextlib.contextmanager
def simulated_streams() -> Iterator[StreamSimulator]:
    """Give CPU ``CommStreams`` simulated side streams and check every buffer's order."""
    simulator = StreamSimulator()
    with using_stream_backend(simulator), _AccessChecker(simulator):
        yield simulator
