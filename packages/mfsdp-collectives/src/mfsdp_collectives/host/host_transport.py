"""Which CPU groups get the shared-memory transport, and its setup and teardown.

``enable_host_transport`` is one collective: every rank reports its host, process and a fresh
mailbox file, and all decide alike. Only when every rank shares this host and pid namespace:
a rank must see its peers' processes to notice one died, so a waiting collective never hangs.
"""

from __future__ import annotations

import contextlib
import os
import platform
import tempfile
import threading
import uuid
import weakref
from dataclasses import dataclass

import torch.distributed as dist

from ..core.fake import is_fake_group
from ..core.naming import group_name
from ..safety.liveness import ProcessIdentity, record_identities
from . import _futex
from .fake_transport import FakeHostTransport
from .shm import DEFAULT_CHUNK_BYTES, DEFAULT_TIMEOUT_S, LANES, SharedMemoryTransport
from .shm_lane import ALIGN, MailboxFile

__all__ = [
    "HOST_TRANSPORTS",
    "check_host_transport",
    "disable_host_transport",
    "enable_host_transport",
    "host_transport_of",
]

HOST_TRANSPORTS = ("auto", "shm", "gloo")
_SHM_DIR = "/dev/shm"
_X86_64 = frozenset({"x86_64", "amd64"})

_transports: weakref.WeakKeyDictionary[dist.ProcessGroup, SharedMemoryTransport] = (
    weakref.WeakKeyDictionary()
)
_registry_lock = threading.Lock()
_OWN_BOXES: dict[str, MailboxFile] = {}  # created, not yet shared: path -> mailbox


@dataclass(frozen=True)
class _HostFacts:
    """What every rank reports so that all take the same transport decision."""

    process: ProcessIdentity
    arch_ok: bool
    path: str | None


def _shm_dir() -> str | None:
    for candidate in (_SHM_DIR, tempfile.gettempdir()):
        if os.path.isdir(candidate) and os.access(candidate, os.W_OK):
            return candidate
    return None


def check_host_transport(value: object) -> None:
    """Raise unless ``value`` names a host transport (local check, no collective)."""
    if value not in HOST_TRANSPORTS:
        raise ValueError(
            f"host_transport={value!r} is not one of {HOST_TRANSPORTS}; pass 'auto' "
            "(shared memory when all ranks share a host), 'shm' or 'gloo'"
        )


def host_transport_of(group: dist.ProcessGroup) -> SharedMemoryTransport | None:
    """The shared-memory transport serving ``group``, if one was enabled."""
    with _registry_lock:
        return _transports.get(group)


def disable_host_transport(group: dist.ProcessGroup | None = None) -> None:
    """Return ``group``'s all-gathers and reduce-scatters to gloo (local; ``None``: every
    group). Issued collectives finish first, then the workers stop and the mailboxes are
    unmapped. Call it on every rank at one point, e.g. before ``destroy_process_group``."""
    with _registry_lock:
        if group is None:
            closing = list(_transports.values())
            _transports.clear()
        else:
            found = _transports.pop(group, None)
            closing = [found] if found is not None else []
    for transport in closing:
        transport.close()


def enable_host_transport(
    group: dist.ProcessGroup,
    transport: str = "auto",
    *,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    timeout_s: float = DEFAULT_TIMEOUT_S,
) -> SharedMemoryTransport | None:
    """Choose how ``group``'s CPU all-gathers and reduce-scatters travel (collective).

    ``"gloo"`` keeps c10d; ``"shm"`` requires shared memory and raises naming what is missing;
    ``"auto"`` takes it where it qualifies (README) and otherwise quietly keeps gloo. Again
    for a group with a transport: that one. A fake group (a planning run) gets
    ``FakeHostTransport``: a real host's route, nothing exchanged.
    """
    check_host_transport(transport)
    if isinstance(chunk_bytes, bool) or not isinstance(chunk_bytes, int) or chunk_bytes < 4096:
        raise ValueError(f"chunk_bytes={chunk_bytes!r} must be an int >= 4096")
    if transport == "gloo":
        return None
    existing = host_transport_of(group)
    if existing is not None:
        return existing
    if is_fake_group(group):  # a planning run: the route of a real host, no memory shared
        with _registry_lock:
            fake = _transports.setdefault(group, FakeHostTransport(group))
        return fake
    backend = str(dist.get_backend(group)).lower()
    if backend != "gloo":
        if transport == "shm":
            raise ValueError(
                f"host_transport='shm' needs a gloo (CPU) group, but group "
                f"{group_name(group)} uses {backend}; pass host_transport='auto' or 'gloo'"
            )
        return None
    slot_bytes = chunk_bytes // ALIGN * ALIGN
    facts = _gather_facts(group, slot_bytes)
    reason = _unsuitable(facts)
    if reason is not None:
        _remove_own(facts[dist.get_rank(group)])
        _refuse(transport, group, reason)
        return None
    rank = dist.get_rank(group)
    boxes, failure = _map_all(facts, rank, slot_bytes)
    # Every rank learns whether every rank mapped every mailbox (after this, the names can
    # go), so that a failure on one rank is a decision on all of them, not a hang.
    failures: list[object] = [None] * len(facts)
    dist.all_gather_object(failures, failure, group=group)
    _remove_own(facts[rank])
    failed = [f"rank {r}: {f}" for r, f in enumerate(failures) if f is not None]
    if failed:
        _refuse(transport, group, f"could not map the mailboxes ({'; '.join(failed)})")
        return None
    peers = [f.process for f in facts]
    record_identities({dist.get_global_rank(group, r): p for r, p in enumerate(peers)})
    made = SharedMemoryTransport(
        group, boxes, rank, chunk_bytes=slot_bytes, timeout_s=timeout_s, peers=peers
    )
    with _registry_lock:
        _transports[group] = made
    return made


def _refuse(transport: str, group: dist.ProcessGroup, reason: str) -> None:
    """No shared memory for ``group``: quietly under ``"auto"``, an error under ``"shm"``."""
    if transport == "shm":
        raise ValueError(
            f"host_transport='shm' is not possible for group {group_name(group)}: {reason}; "
            "pass host_transport='auto' or 'gloo'"
        )


def _map_all(
    facts: list[_HostFacts], rank: int, slot_bytes: int
) -> tuple[list[MailboxFile], str | None]:
    boxes: list[MailboxFile] = []
    for peer, fact in enumerate(facts):
        assert fact.path is not None
        if peer == rank:
            boxes.append(_OWN_BOXES[fact.path])
            continue
        try:
            boxes.append(MailboxFile(fact.path, slot_bytes, LANES, create=False))
        except OSError as exc:
            return [], f"{fact.path}: {exc.strerror}"
    return boxes, None


def _gather_facts(group: dist.ProcessGroup, slot_bytes: int) -> list[_HostFacts]:
    directory = _shm_dir()
    path: str | None = None
    if directory is not None:
        path = os.path.join(directory, f"mfsdp-{os.getpid()}-{uuid.uuid4().hex}")
        try:
            _OWN_BOXES[path] = MailboxFile(path, slot_bytes, LANES, create=True)
        except OSError:
            path = None
    mine = _HostFacts(
        process=ProcessIdentity.of_this_process(),
        arch_ok=platform.machine().lower() in _X86_64
        and platform.system() == "Linux"
        and _futex.available(),
        path=path,
    )
    facts: list[object] = [None] * dist.get_world_size(group)
    dist.all_gather_object(facts, mine, group=group)
    return [f for f in facts if isinstance(f, _HostFacts)]


def _unsuitable(facts: list[_HostFacts]) -> str | None:
    if len({f.process.host for f in facts}) > 1:
        return "its ranks run on more than one host (or in different pid namespaces)"
    if not all(f.arch_ok for f in facts):
        return "the shared-memory protocol needs Linux on x86-64 CPUs (store order, futex)"
    if any(f.path is None for f in facts):
        return "a rank could not create its mailbox in /dev/shm or the temp directory"
    return None


def _remove_own(fact: _HostFacts) -> None:
    if fact.path is None:
        return
    _OWN_BOXES.pop(fact.path, None)
    with contextlib.suppress(FileNotFoundError):
        os.unlink(fact.path)
