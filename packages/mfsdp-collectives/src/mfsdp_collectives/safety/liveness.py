"""Which peer processes are still alive, so a collective waiting on a dead rank says so.

A SIGKILLed rank announces nothing: gloo's error ("Connection closed by peer") names no rank,
and the shared-memory transport waits on a word a dead process stops updating. On Linux a
process can tell from ``/proc/<pid>/stat`` whether another on its host is alive, and a
(pid, start time) pair is not fooled by pid reuse. Each rank learns its peers'
``ProcessIdentity`` once per group, in a collective made anyway; ``dead_ranks`` is then local,
cheap enough to ask twice a second. Peers on other hosts cannot be checked.
"""

from __future__ import annotations

import os
import socket
import threading
import time
import weakref
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import TypeVar

import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException

__all__ = [
    "PeerDiedError",
    "ProcessIdentity",
    "call_watching_peers",
    "dead_ranks",
    "exchange_identities",
    "identities_known",
    "naming_dead_peers",
    "peer_died_error",
    "record_identities",
]

# After a collective failed, how long the kernel may take to show the peer's death in /proc:
# its sockets close (which is what gloo saw) before the process turns into a zombie.
_SETTLE_S = 2.0
_SETTLE_POLL_S = 0.02
# How often a rendezvous' waiter looks for dead members (call_watching_peers).
_WATCH_POLL_S = 0.25

T = TypeVar("T")


def _read(path: str) -> str | None:
    try:
        with open(path, encoding="ascii", errors="replace") as f:
            return f.read().strip()
    except OSError:
        return None


def _host_key() -> str:
    """Processes with equal keys can see each other's pids (same machine, boot, namespace)."""
    boot = _read("/proc/sys/kernel/random/boot_id") or ""
    try:
        namespace = os.readlink("/proc/self/ns/pid")
    except OSError:
        namespace = ""
    return f"{socket.gethostname()}/{boot}/{namespace}"


def _stat_fields(pid: int) -> list[str] | None:
    """``/proc/<pid>/stat`` from the state field on (the name before it may hold spaces)."""
    text = _read(f"/proc/{pid}/stat")
    if text is None:
        return None
    return text[text.rfind(")") + 2 :].split()


@dataclass(frozen=True)
class ProcessIdentity:
    """One rank's process, as other processes on its host can recognise it."""

    host: str
    pid: int
    start_ticks: int  # field 22 of /proc/<pid>/stat: tells a reused pid from the original

    @classmethod
    def of_this_process(cls) -> ProcessIdentity:
        fields = _stat_fields(os.getpid())
        start = int(fields[19]) if fields is not None and len(fields) > 19 else -1
        return cls(host=_host_key(), pid=os.getpid(), start_ticks=start)

    def is_alive(self) -> bool | None:
        """False once the process is gone or a zombie; None when it cannot be checked here."""
        if self.start_ticks < 0 or self.host != _THIS_HOST:
            return None
        fields = _stat_fields(self.pid)
        if fields is None or len(fields) < 20:
            return False
        if fields[0] in ("Z", "X", "x"):
            return False
        return int(fields[19]) == self.start_ticks


_THIS_HOST = _host_key()
_lock = threading.Lock()
_known: dict[int, ProcessIdentity] = {}  # global rank -> its process
# The groups whose members' processes were learned. Weak: a group object lives as long as
# c10d registers it (its ``_world`` maps hold it until ``destroy_process_group``), and a world
# destroyed and initialised again is made of new group objects, so its ranks (perhaps other
# processes now) are exchanged again. An ``id()`` could be reused by a new group once the old
# one is freed; a weak reference dies with its group instead.
_groups_known: weakref.WeakSet[dist.ProcessGroup] = weakref.WeakSet()


class PeerDiedError(RuntimeError):
    """A collective could not finish because the processes of ``ranks`` (global) died."""

    def __init__(self, ranks: list[int], message: str) -> None:
        super().__init__(message)
        self.ranks = ranks

    def __reduce__(self) -> tuple[type[PeerDiedError], tuple[list[int], str]]:
        return (type(self), (self.ranks, str(self)))


def record_identities(
    identities: Mapping[int, ProcessIdentity], group: dist.ProcessGroup | None = None
) -> None:
    """Remember the processes of these global ranks (what an exchange learned), and that
    those of ``group`` (all its ranks, when given) are known (``identities_known``)."""
    with _lock:
        _known.update(identities)
        if group is not None:
            _groups_known.add(group)


def identities_known(group: dist.ProcessGroup) -> bool:
    """Whether this process learned the processes of every rank of ``group`` (this process
    only: ranks may differ, so a collective deciding on it must exchange the answer)."""
    with _lock:
        return group in _groups_known


def exchange_identities(group: dist.ProcessGroup) -> None:
    """Learn the process of every rank of ``group`` (collective over ``group``)."""
    found: list[object] = [None] * dist.get_world_size(group)
    dist.all_gather_object(found, ProcessIdentity.of_this_process(), group=group)
    record_identities(
        {
            dist.get_global_rank(group, r): ident
            for r, ident in enumerate(found)
            if isinstance(ident, ProcessIdentity)
        },
        group,
    )


def dead_ranks(ranks: Iterable[int] | None = None) -> list[int]:
    """The global ranks (among ``ranks``, default all known) whose process is certainly gone."""
    with _lock:
        known = dict(_known)
    wanted = sorted(known) if ranks is None else sorted(r for r in set(ranks) if r in known)
    return [r for r in wanted if known[r].is_alive() is False]


def peer_died_error(ranks: list[int], during: str) -> PeerDiedError:
    """The error that names the dead ranks (global) and what was waiting for them."""
    with _lock:
        pids = ", ".join(f"rank {r} (pid {_known[r].pid})" for r in ranks if r in _known)
    return PeerDiedError(
        ranks,
        f"{during} cannot finish: the process of {pids or ranks} died (killed, out of memory "
        "or crashed). Its work since the last checkpoint is lost; restart the job from the "
        "latest checkpoint (with torchrun, the agent does this for --max-restarts)",
    )


def _watchable(ranks: Iterable[int]) -> bool:
    """Whether any of ``ranks`` (global) is known to be another process ``dead_ranks`` can see."""
    me = os.getpid()
    with _lock:
        found = [_known[r] for r in ranks if r in _known]
    return any(i.host == _THIS_HOST and i.pid != me and i.start_ticks >= 0 for i in found)


def call_watching_peers(call: Callable[[], T], ranks: Iterable[int], during: str) -> T:
    """``call()`` (a rendezvous, e.g. creating a group: it has no error for a dead member, only
    the store's 30-minute timeout) on a daemon helper thread while this one watches the
    processes of ``ranks`` (global), raising ``PeerDiedError`` as soon as one is gone (the
    helper is left blocked). This thread only waits meanwhile, so no other c10d call of it runs
    beside ``call``.

    With no member known to be another process of this host, ``call()`` runs on this thread:
    c10d's state may be per thread (torch's threaded process group), and a helper thread would
    find no default group."""
    members = list(ranks)
    if not _watchable(members):
        return call()
    outcome: list[T] = []
    failure: list[BaseException] = []

    def run() -> None:
        try:
            outcome.append(call())
        except BaseException as error:  # raised below, on the waiting thread
            failure.append(error)

    helper = threading.Thread(target=run, name="mfsdp-rendezvous", daemon=True)
    helper.start()
    while helper.is_alive():
        helper.join(_WATCH_POLL_S)
        dead = dead_ranks(members) if helper.is_alive() else []
        if dead:
            raise peer_died_error(dead, during)
    if failure:
        raise failure[0]
    return outcome[0]


def explain_failure(during: str, ranks: Iterable[int] | None = None) -> PeerDiedError | None:
    """After a collective failed: the error naming dead peers, if any died (waits briefly)."""
    deadline = time.monotonic() + _SETTLE_S
    with _lock:
        checkable = bool(_known)
    while checkable:
        dead = dead_ranks(ranks)
        if dead:
            return peer_died_error(dead, during)
        if time.monotonic() >= deadline:
            break
        time.sleep(_SETTLE_POLL_S)
    return None


def _is_backend_failure(exc: BaseException) -> bool:
    """An error a collective backend raises (gloo: a bare ``RuntimeError``; c10d: a
    ``DistError``; DCP: the ``CheckpointException`` wrapping a rank's failure). Errors of
    ours or the user's are never blamed on a peer, and never wait for one to look dead."""
    return type(exc) is RuntimeError or isinstance(exc, (dist.DistError, CheckpointException))


class naming_dead_peers:  # a context manager, lower case as the function it was
    """Turn a backend error caused by a dead peer into a ``PeerDiedError`` naming it.

    A class, not a ``contextlib`` generator: it wraps every collective the engine issues,
    and a generator's frames cost the host more than the collective's own bookkeeping."""

    __slots__ = ("_during", "_group")

    def __init__(self, during: str, group: dist.ProcessGroup | None = None) -> None:
        self._during = during
        self._group = group

    def __enter__(self) -> None:
        return None

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: object
    ) -> None:
        if exc is None or not _is_backend_failure(exc):
            return  # nothing raised, or not a dead peer's doing: it propagates as it is
        group = self._group
        ranks = None if group is None else dist.get_process_group_ranks(group)
        explained = explain_failure(self._during, ranks)
        if explained is not None:
            raise explained from exc
