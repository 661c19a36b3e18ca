"""What the host issues for one call (a training step), counted rather than timed.

On a GPU a step of many small layers is bound by the host: the ops it dispatches and the
Python it runs between them. Times vary by machine; these counts do not, so tests can hold
them against FSDP2's and benchmarks can print them beside the times.
"""

from __future__ import annotations

import sys
from collections import Counter
from collections.abc import Callable, Iterable
from pathlib import Path
from types import FrameType, ModuleType
from typing import Any

from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["AtenOpCount", "engine_entries", "package_dirs"]


class AtenOpCount(TorchDispatchMode):  # type: ignore[no-untyped-call]
    """Counts the aten ops dispatched to kernels while active (``with AtenOpCount() as c``):
    below autograd and DTensor's dispatch, so a DTensor op counts as the local op it runs."""

    def __init__(self) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.ops = 0

    def __torch_dispatch__(
        self, func: Any, types: Any, args: Any = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        self.ops += 1
        return func(*args, **(kwargs or {}))


def package_dirs(packages: Iterable[ModuleType]) -> tuple[str, ...]:
    """The source folders of ``packages`` (an engine's code, for :func:`engine_entries`)."""
    return tuple(str(Path(p.__file__ or "").parent) for p in packages)


def engine_entries(call: Callable[[], object], dirs: tuple[str, ...]) -> Counter[str]:
    """Run ``call``; count by function name each call into code under ``dirs`` whose caller
    is not (the host entering the engine). Single-threaded calls only (``sys.setprofile``)."""
    entries: Counter[str] = Counter()

    def inside(frame: FrameType | None) -> bool:
        return frame is not None and frame.f_code.co_filename.startswith(dirs)

    def profile(frame: FrameType, event: str, arg: object) -> None:
        if event == "call" and inside(frame) and not inside(frame.f_back):
            entries[frame.f_code.co_name] += 1

    previous = sys.getprofile()
    sys.setprofile(profile)
    try:
        call()
    finally:
        sys.setprofile(previous)
    return entries
