"""Run a function on N ranks, each a process with torch.distributed initialised: the package
README's "The test harness" (fails fast with the failing rank's traceback, kills a hung world
at the timeout, reports a silent death with its exit code; cheap forkserver start-up).
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import multiprocessing
import multiprocessing.connection
import os
import pickle
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from multiprocessing.connection import Connection
from multiprocessing.context import BaseContext
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from ..host.host_transport import disable_host_transport
from ._hash_seeds import check_hash_seeds, hash_seed

__all__ = ["DistributedTestError", "RankOutcome", "run_distributed", "run_distributed_outcomes"]

T = TypeVar("T")

_HOST = "127.0.0.1"
# The process group's own timeout is longer than the harness's, so that a hang
# is reported as a TimeoutError by the harness rather than as whichever
# collective error a rank happens to raise first.
_PG_TIMEOUT_MARGIN_S = 30.0
_KILL_GRACE_S = 5.0
_FAILURE_GRACE_S = 1.0
_DIED = "ProcessExit"
_PRELOAD = [
    "torch",
    "torch.distributed",
    "torch.distributed.device_mesh",
    "torch.distributed.tensor",  # DTensor, and what torch.testing.assert_close imports lazily
    "torch._dynamo",  # imported lazily by DTensor.from_local: ~1-3 s in every rank otherwise
    "mfsdp_collectives.testing",
]


class DistributedTestError(Exception):
    """A rank raised; carries its rank, exception type/message and traceback text."""

    def __init__(
        self,
        rank: int,
        exc_type: str,
        exc_message: str,
        remote_traceback: str,
        exception: BaseException | None = None,
    ) -> None:
        self.rank = rank
        self.exc_type = exc_type
        self.exc_message = exc_message
        self.remote_traceback = remote_traceback
        self.exception = exception
        super().__init__(
            f"rank {rank} raised {exc_type}: {exc_message}\n\n"
            f"--- traceback on rank {rank} ---\n{remote_traceback.rstrip()}"
        )

    def __reduce__(self) -> tuple[Any, ...]:
        return (
            type(self),
            (self.rank, self.exc_type, self.exc_message, self.remote_traceback, None),
        )


@dataclass(frozen=True)
class _FnRef:
    """How a rank finds ``fn``: by module and qualified name, with the file as fallback
    (under pytest's ``importlib`` import mode test modules are not importable by name)."""

    module: str
    qualname: str
    file: str | None

    @classmethod
    def of(cls, fn: Callable[..., Any]) -> _FnRef:
        if not callable(fn):
            raise TypeError(f"fn must be callable, got {type(fn).__name__}")
        module = getattr(fn, "__module__", None)
        qualname = getattr(fn, "__qualname__", None)
        if not module or not qualname or "<" in qualname:
            raise TypeError(
                f"fn must be a module-level function so rank processes can import it, got "
                f"{qualname or fn!r}; define it at the top level of the test module and pass "
                "extra values through *args"
            )
        file = getattr(sys.modules.get(module), "__file__", None)
        return cls(module=module, qualname=qualname, file=file)

    def resolve(self) -> Callable[..., Any]:
        try:
            obj: Any = importlib.import_module(self.module)
        except ImportError:
            if self.file is None:
                raise
            spec = importlib.util.spec_from_file_location(self.module, self.file)
            if spec is None or spec.loader is None:
                raise
            obj = importlib.util.module_from_spec(spec)
            sys.modules[self.module] = obj
            spec.loader.exec_module(obj)
        for part in self.qualname.split("."):
            obj = getattr(obj, part)
        if not callable(obj):
            raise TypeError(f"{self.module}.{self.qualname} is not callable")
        return obj  # type: ignore[no-any-return]


_context_cache: BaseContext | None = None


def _context() -> BaseContext:
    """A forkserver context with torch preloaded (spawn where there is no forkserver)."""
    global _context_cache
    if _context_cache is None:
        if "forkserver" in multiprocessing.get_all_start_methods():
            ctx = multiprocessing.get_context("forkserver")
            ctx.set_forkserver_preload(_PRELOAD)
            _context_cache = ctx
        else:  # pragma: no cover - Windows
            _context_cache = multiprocessing.get_context("spawn")
    return _context_cache


def _set_device(rank: int, backend: str) -> None:
    """Give each rank its own accelerator for device backends (NCCL, XCCL, ...)."""
    if backend == "gloo" or not torch.accelerator.is_available():
        return
    count = torch.accelerator.device_count()
    if count > 0:
        torch.accelerator.set_device_index(rank % count)


def _worker(
    ref: _FnRef,
    rank: int,
    world_size: int,
    port: int,
    args: tuple[Any, ...],
    env: dict[str, str],
    backend: str,
    timeout: float,
    conn: Connection,
) -> None:
    """Entry point of one rank: init, run, report, tear down."""
    try:
        os.environ.update(env)
        os.environ.update(
            MASTER_ADDR=_HOST,
            MASTER_PORT=str(port),
            RANK=str(rank),
            LOCAL_RANK=str(rank),
            WORLD_SIZE=str(world_size),
            LOCAL_WORLD_SIZE=str(world_size),
        )
        torch.set_num_threads(max(1, int(os.environ.get("OMP_NUM_THREADS", "1"))))
        _set_device(rank, backend)
        fn = ref.resolve()
        store = dist.TCPStore(  # type: ignore[attr-defined]
            _HOST, port, is_master=False, timeout=timedelta(seconds=timeout)
        )
        dist.init_process_group(
            backend,
            store=store,
            rank=rank,
            world_size=world_size,
            timeout=timedelta(seconds=timeout + _PG_TIMEOUT_MARGIN_S),
        )
        # Every rank finishes connecting before any may run, return and close its sockets
        # (gloo's full-mesh connect fails when a fast peer has already gone).
        dist.barrier()
        result = fn(rank, world_size, *args)
        try:
            conn.send(("ok", rank, time.monotonic(), result))
        except Exception as exc:
            raise TypeError(
                f"the value returned by {ref.qualname} on rank {rank} cannot be sent back "
                f"to the test process ({exc}); return picklable values (e.g. .tolist())"
            ) from exc
    except BaseException as exc:  # every failure must reach the parent
        _report_failure(conn, rank, exc)
        conn.close()
        os._exit(1)  # skip teardown: peers may be stuck in a collective with us
    if dist.is_initialized():
        disable_host_transport()
        dist.destroy_process_group()
    conn.close()


def _report_failure(conn: Connection, rank: int, exc: BaseException) -> None:
    try:
        blob: bytes | None = pickle.dumps(exc)
    except Exception:  # unpicklable: still reported as text
        blob = None
    message = (
        "err",
        rank,
        time.monotonic(),
        type(exc).__qualname__,
        str(exc),
        "".join(traceback.format_exception(type(exc), exc, exc.__traceback__)),
        blob,
    )
    with contextlib.suppress(Exception):  # parent gone: nothing left to tell
        conn.send(message)


def _validate(world_size: object, timeout: object, backend: object, env: object) -> None:
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive int, got {world_size!r}")
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or timeout <= 0:
        raise ValueError(f"timeout must be a positive number of seconds, got {timeout!r}")
    if not isinstance(backend, str) or not backend:
        raise ValueError(f"backend must be a backend name such as 'gloo', got {backend!r}")
    if env is not None and not (
        isinstance(env, dict)
        and all(isinstance(k, str) and isinstance(v, str) for k, v in env.items())
    ):
        raise TypeError("env must be a dict[str, str] of environment variables, or None")


def run_distributed(
    fn: Callable[..., T],
    world_size: int,
    *args: Any,
    timeout: float = 120.0,
    backend: str = "gloo",
    env: dict[str, str] | None = None,
    hash_seeds: Sequence[int] | None = None,
) -> list[T]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` ranks; return results by rank.

    ``env`` is applied in each rank before the process group is created (torch is imported
    by then: variables torch reads at import must be set in the test process).
    ``hash_seeds``: a ``PYTHONHASHSEED`` per rank, as under torchrun (spawned: ``_hash_seeds``).
    """
    check_hash_seeds(hash_seeds, world_size)
    outcomes = _run_world(fn, world_size, args, timeout, backend, env, _FAILURE_GRACE_S, hash_seeds)
    failures = [(o.at, o.error) for o in outcomes if o.error is not None]
    if failures:
        raise _root_cause(failures)
    return [o.result for o in outcomes]


@dataclass(frozen=True)
class RankOutcome:
    """How one rank ended: its result, or the error it raised, or its death; and ``at`` when
    (``time.monotonic()``, shared by the host's processes, so outcomes compare)."""

    rank: int
    result: Any
    error: DistributedTestError | None
    at: float

    @property
    def died(self) -> bool:
        """The process ended without a report (a signal, ``os._exit``)."""
        return self.error is not None and self.error.exc_type == _DIED


def run_distributed_outcomes(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout: float = 120.0,
    backend: str = "gloo",
    env: dict[str, str] | None = None,
) -> list[RankOutcome]:
    """Like ``run_distributed``, but wait for every rank and return each one's outcome (for
    fault-injection tests); only a world still running after ``timeout`` raises."""
    return _run_world(fn, world_size, args, timeout, backend, env, None)


def _run_world(
    fn: Callable[..., Any],
    world_size: int,
    args: tuple[Any, ...],
    timeout: float,
    backend: str,
    env: dict[str, str] | None,
    grace: float | None,
    hash_seeds: Sequence[int] | None = None,
) -> list[RankOutcome]:
    _validate(world_size, timeout, backend, env)
    ref = _FnRef.of(fn)
    worker_env = {"OMP_NUM_THREADS": "1", **(env or {})}  # 4 ranks on 2 cores: no thrashing
    ctx = _context() if hash_seeds is None else multiprocessing.get_context("spawn")
    # The parent binds a port the OS picks and hands it out: no free-port race between tests.
    store = dist.TCPStore(  # type: ignore[attr-defined]
        _HOST, 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=timeout)
    )
    procs: list[Any] = []
    conns: list[Connection] = []
    succeeded = False
    try:
        for rank in range(world_size):
            recv, send = ctx.Pipe(duplex=False)
            proc = ctx.Process(  # type: ignore[attr-defined]
                target=_worker,
                args=(ref, rank, world_size, store.port, args, worker_env, backend, timeout, send),
                name=f"{ref.qualname}-rank{rank}",
                daemon=False,  # ranks may start their own workers (data loaders)
            )
            with hash_seed(None if hash_seeds is None else hash_seeds[rank]):
                proc.start()
            send.close()
            procs.append(proc)
            conns.append(recv)
        outcomes = _collect(ref, procs, conns, float(timeout), grace)
        succeeded = all(o.error is None for o in outcomes)
        return outcomes
    finally:
        # After success, give the ranks time to tear down; after a failure, kill now.
        _stop(procs, grace=_KILL_GRACE_S if succeeded else 0.0)
        for conn in conns:
            conn.close()
        del store


def _collect(
    ref: _FnRef, procs: list[Any], conns: list[Connection], timeout: float, grace: float | None
) -> list[RankOutcome]:
    """Wait for every rank's report, or stop listening ``grace`` seconds after the first
    failure (``None``: wait for all): the rank that caused it may have died silently (seen
    only through its sentinel), and its peers' "connection reset" must not mask it."""
    world_size = len(procs)
    deadline = time.monotonic() + timeout
    grace_deadline: float | None = None
    outcomes: dict[int, RankOutcome] = {}
    rank_of_conn: dict[Connection, int] = {conn: rank for rank, conn in enumerate(conns)}
    rank_of_sentinel: dict[int, int] = {proc.sentinel: rank for rank, proc in enumerate(procs)}
    while len(outcomes) < world_size:
        limit = deadline if grace_deadline is None else min(deadline, grace_deadline)
        remaining = limit - time.monotonic()
        if remaining <= 0:
            if grace_deadline is not None:
                break
            running = [r for r in range(world_size) if r not in outcomes]
            raise TimeoutError(
                f"run_distributed({ref.qualname}, world_size={world_size}) did not finish "
                f"within {timeout:g}s; ranks still running: {running}"
            )
        ready = multiprocessing.connection.wait(
            [*rank_of_conn, *rank_of_sentinel], timeout=remaining
        )
        # Reports first: a rank that sent its result and then exited is not a crash.
        for conn in [c for c in rank_of_conn if c in ready]:
            _read_report(conn, rank_of_conn.pop(conn), outcomes)
        for sentinel in [s for s in rank_of_sentinel if s in ready]:
            rank = rank_of_sentinel.pop(sentinel)
            for conn in [c for c, r in rank_of_conn.items() if r == rank]:
                del rank_of_conn[conn]
                if conn.poll():
                    _read_report(conn, rank, outcomes)
            if rank not in outcomes:
                died = _died(rank, procs[rank].exitcode)
                outcomes[rank] = RankOutcome(rank, None, died, time.monotonic())
        failed = any(o.error is not None for o in outcomes.values())
        if failed and grace is not None and grace_deadline is None:
            grace_deadline = time.monotonic() + grace
    return [outcomes[r] for r in sorted(outcomes)]


def _root_cause(failures: list[tuple[float, DistributedTestError]]) -> DistributedTestError:
    """A silent death explains its peers' errors; otherwise the earliest exception wins."""
    deaths = [f for f in failures if f[1].exc_type == _DIED]
    return min(deaths or failures, key=lambda f: f[0])[1]


def _died(rank: int, exitcode: int | None) -> DistributedTestError:
    return DistributedTestError(
        rank,
        _DIED,
        f"rank {rank} exited with code {exitcode} without reporting a result",
        "(no Python traceback: the process died)",
    )


def _read_report(conn: Connection, rank: int, outcomes: dict[int, RankOutcome]) -> None:
    try:
        msg = conn.recv()
    except (EOFError, OSError):
        return  # the sentinel reports the death
    if msg[0] == "ok":
        outcomes[rank] = RankOutcome(rank, msg[3], None, msg[2])
        return
    _, rank, stamp, exc_type, exc_message, tb, blob = msg
    original: BaseException | None = None
    if blob is not None:
        try:
            original = pickle.loads(blob)
        except Exception:  # the text report is enough
            original = None
    error = DistributedTestError(rank, exc_type, exc_message, tb, original)
    outcomes[rank] = RankOutcome(rank, None, error, stamp)


def _stop(procs: list[Any], *, grace: float) -> None:
    """Kill whatever is still running after ``grace`` seconds and reap everything."""
    deadline = time.monotonic() + grace
    for proc in procs:
        proc.join(timeout=max(0.0, deadline - time.monotonic()))
    for proc in procs:
        if proc.is_alive():
            proc.kill()
    for proc in procs:
        proc.join(timeout=_KILL_GRACE_S)
