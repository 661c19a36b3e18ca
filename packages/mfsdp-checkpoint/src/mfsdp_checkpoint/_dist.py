"""Tiny helpers over ``torch.distributed`` that also work in a single, non-distributed process.

The one idea here is *agreement*: a rank that finds a problem (a missing file, a bad key) does
not raise on its own, it shares the problem with the others first, so every rank raises the
same error together and no rank is left waiting in a collective.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator

import torch.distributed as dist

from mfsdp_checkpoint.errors import ERROR_TYPES, CheckpointError

Problem = tuple[str, str] | None
"""``(error class name, message)`` of a rank's local check, or None when it passed."""


def is_distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def rank(group: dist.ProcessGroup | None = None) -> int:
    return dist.get_rank(group) if is_distributed() else 0


def world_size(group: dist.ProcessGroup | None = None) -> int:
    return dist.get_world_size(group) if is_distributed() else 1


def problem_of(error: BaseException) -> Problem:
    """Describe a local failure so it can travel to the other ranks."""
    name = type(error).__name__ if type(error).__name__ in ERROR_TYPES else "CheckpointError"
    return (name, str(error) or type(error).__name__)


def agree(problem: Problem, group: dist.ProcessGroup | None = None) -> None:
    """Raise on every rank if any rank reported a problem; return quietly otherwise.

    One ``all_gather_object`` per call: cheap next to the I/O it guards.
    """
    problems: list[Problem] = [problem]
    if is_distributed():
        problems = [None] * dist.get_world_size(group)
        dist.all_gather_object(problems, problem, group=group)
    failed = [(r, p) for r, p in enumerate(problems) if p is not None]
    if not failed:
        return
    kind = failed[0][1][0]
    messages = {p[1] for _, p in failed}
    if len(messages) == 1:
        message = failed[0][1][1]
    else:
        message = "\n".join(f"rank {r}: {p[1]}" for r, p in failed)
    raise ERROR_TYPES.get(kind, CheckpointError)(message)


def global_rank_of(group_rank: int, group: dist.ProcessGroup | None) -> int:
    """The global rank of ``group_rank`` in ``group`` (collectives take global ranks)."""
    return group_rank if group is None else dist.get_global_rank(group, group_rank)


@contextlib.contextmanager
def quiet_single_process() -> Iterator[None]:
    """Silence DCP's "assuming the intent is to ... in a single process" warning: in a
    single process that *is* the intent (conversions, the command line, one-rank jobs)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*assuming the intent is to")
        yield
