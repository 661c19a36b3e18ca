"""SIGKILL the current process at a chosen point of a save, to test what a crash leaves behind.

A trigger is a picklable tuple, armed inside the rank that is to die (patches live only in that
process; no library code is changed):

* ``("bytes", suffix, n)``: the first file DCP writes whose name ends in ``suffix`` gets
  exactly ``n`` bytes (flushed to the OS, as a crash would leave them), then the process dies.
* ``("closed", suffix)``: dies right after that file is complete and closed.
* ``("call", "before" | "after", module, qualname)``: dies before or after a function runs.
* ``("path", method, name, "before" | "after")``: dies around ``Path.<method>`` (``rename``,
  ``replace``, ``unlink``) called on a path named ``name``.
* ``("rmtree", suffix)``: a ``shutil.rmtree`` of a directory ending in ``suffix`` is killed
  part-way, after deleting the in-progress sentinel and the completion marker (the worst order
  ``os.scandir`` can give).
"""

from __future__ import annotations

import contextlib
import importlib
import os
import shutil
import signal
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, NoReturn

from torch.distributed.checkpoint.filesystem import FileSystem

from mfsdp_checkpoint.marker import IN_PROGRESS, MARKER

Trigger = tuple[Any, ...]


def die() -> NoReturn:
    os.kill(os.getpid(), signal.SIGKILL)
    raise AssertionError("SIGKILL did not stop the process")


class _DyingStream:
    """A binary stream that lets ``budget`` bytes through, then kills the process."""

    def __init__(self, raw: Any, budget: int) -> None:
        self._raw = raw
        self._left = budget

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        if len(view) < self._left:
            self._left -= len(view)
            return int(self._raw.write(view))
        self._raw.write(view[: self._left])
        self._raw.flush()
        die()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._raw, name)


def _patch_streams(suffix: str, budget: int | None) -> None:
    original = FileSystem.create_stream

    @contextlib.contextmanager
    def create_stream(self: FileSystem, path: Any, mode: str) -> Iterator[Any]:
        matches = "w" in mode and str(path).endswith(suffix)
        with original(self, path, mode) as stream:
            yield _DyingStream(stream, budget) if matches and budget is not None else stream
        if matches:
            die()  # "closed": the file is complete; with a budget we never get here

    FileSystem.create_stream = create_stream  # type: ignore[method-assign]


def _patch_call(when: str, module_name: str, qualname: str) -> None:
    owner: Any = importlib.import_module(module_name)
    *parents, attr = qualname.split(".")
    for parent in parents:
        owner = getattr(owner, parent)
    original: Callable[..., Any] = getattr(owner, attr)

    def dying(*args: Any, **kwargs: Any) -> Any:
        if when == "before":
            die()
        original(*args, **kwargs)
        die()

    setattr(owner, attr, dying)


def _patch_path(method: str, name: str, when: str) -> None:
    original: Callable[..., Any] = getattr(Path, method)

    def dying(self: Path, *args: Any, **kwargs: Any) -> Any:
        if self.name != name:
            return original(self, *args, **kwargs)
        if when == "before":
            die()
        original(self, *args, **kwargs)
        die()

    setattr(Path, method, dying)


def _patch_rmtree(suffix: str) -> None:
    original = shutil.rmtree

    def dying(path: Any, *args: Any, **kwargs: Any) -> None:
        if not str(path).endswith(suffix):
            original(path, *args, **kwargs)
            return
        for name in (IN_PROGRESS, MARKER):
            (Path(path) / name).unlink(missing_ok=True)
        die()

    shutil.rmtree = dying  # type: ignore[assignment]


def arm(trigger: Trigger, path: str) -> None:
    """Install ``trigger`` in this process; ``<target>``/``<staging>`` name ``path``'s dirs."""
    names = {"<target>": Path(path).name, "<staging>": Path(path).name + ".partial"}
    kind, *rest = [names.get(part, part) if isinstance(part, str) else part for part in trigger]
    rest_any: list[Any] = rest
    if kind == "bytes":
        _patch_streams(rest_any[0], rest_any[1])
    elif kind == "closed":
        _patch_streams(rest_any[0], None)
    elif kind == "call":
        _patch_call(*rest_any)
    elif kind == "path":
        _patch_path(*rest_any)
    elif kind == "rmtree":
        _patch_rmtree(rest_any[0])
    else:
        raise ValueError(f"trigger: unknown kind {kind!r}")
