"""``megatron_fsdp.trace(model, optimizer)``: where did a training step's time go?

The user's handle on layer 3's recording (``mfsdp_hooks.record_timeline``), its Chrome trace
and overlap report. Each rank records itself; nothing is communicated. See
``docs/timeline.md``.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from mfsdp_hooks import (
    OverlapReport,
    TimelineRecorder,
    TimelineStep,
    build_overlap_report,
    chrome_trace,
    fsdp_units,
    optimizer_groups,
    record_timeline,
)

__all__ = ["OverlapReport", "Timeline", "trace"]


class Timeline:
    """What ``trace`` recorded on this rank. ``steps`` are the complete steps so far (all of
    them once the ``with`` block ended); a step runs from the root's forward to the end of
    the optimizer's step (without an optimizer: to the next forward of the root)."""

    def __init__(self, recorder: TimelineRecorder) -> None:
        self._recorder = recorder
        self.rank = dist.get_rank() if dist.is_initialized() else 0

    @property
    def steps(self) -> list[TimelineStep]:
        return list(self._recorder.steps)

    @property
    def units(self) -> list[str]:
        """The traced units' names as events give them (``blocks.0 (Block)``), module order."""
        return self._recorder.unit_labels()

    def chrome_trace(self) -> dict[str, Any]:
        """Chrome Trace Event Format (``{"traceEvents": [...], "displayTimeUnit": "ms"}``):
        ``pid`` is the rank, one ``tid`` per lane, microseconds since the trace began."""
        return chrome_trace(self.steps, self.rank, self._recorder.origin_ns)

    def save(self, path: str | os.PathLike[str]) -> Path:
        """Write ``chrome_trace()`` as JSON to ``path`` atomically (a temporary file in the
        same directory, then ``os.replace``): a reader never sees half a file."""
        target = Path(path)
        text = json.dumps(self.chrome_trace())
        # Beside the target (one file system, so the rename is atomic), named per process.
        temporary = target.with_name(f".{target.name}.{os.getpid()}.tmp")
        try:
            temporary.write_text(text)
            os.replace(temporary, target)
        except BaseException:
            temporary.unlink(missing_ok=True)
            raise
        return target

    def overlap_report(self, warmup_steps: int = 0) -> OverlapReport:
        """Per unit and in total, where the host's time went (see ``OverlapReport``), over the
        steps after the first ``warmup_steps`` (the first step records the execution order
        and prefetches nothing; its optimizer step creates the state)."""
        if not isinstance(warmup_steps, int) or warmup_steps < 0:
            raise ValueError(f"warmup_steps must be an int >= 0, got {warmup_steps!r}")
        return build_overlap_report(self.steps[warmup_steps:], self.units, self.rank)


def _check_optimizer(optimizer: object, model: nn.Module) -> None:
    if optimizer is None:
        return
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(
            f"optimizer must be a torch.optim.Optimizer or None, got {type(optimizer).__name__}"
        )
    mine = {id(group) for unit in fsdp_units(model) for group in unit.groups}
    if not any(id(group) in mine for group in optimizer_groups(optimizer)):
        raise ValueError(
            "optimizer steps none of the traced model's sharded parameters: pass the "
            "optimizer built on this model (or optimizer=None to end steps at each forward)"
        )


@contextlib.contextmanager
def trace(model: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> Iterator[Timeline]:
    """Record where each training step's time goes on this rank while the block runs.

    ``model``: a sharded model (``MegatronFSDP``, or the root of ``fully_shard`` calls).
    ``optimizer``: the one that steps it; its step ends each step and is timed (through
    torch's optimizer step hooks, removed when the block ends). Yields a ``Timeline``,
    complete when the block ends. One trace at a time per process.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
    units = fsdp_units(model)
    if not units:
        raise ValueError(
            f"model: {type(model).__name__} has no FSDP units to trace; pass the sharded "
            "model (what fully_shard / fully_shard_model returns, or a fully_shard root)"
        )
    root = units[0].root
    if root is not None and all(root.root_unit is not unit for unit in units):
        raise ValueError(
            f"model: {type(model).__name__} is inside a larger FSDP model whose forward "
            f"starts at {root.root_unit.name}; trace that root model instead"
        )
    _check_optimizer(optimizer, model)
    with record_timeline(units, optimizer) as recorder:
        yield Timeline(recorder)
