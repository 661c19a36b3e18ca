"""Wrapping frees the model's original parameters at once, not at a later garbage collection.

The unit copies each original parameter into its flat buffers and drops it; nothing of the
wrap may keep it in a reference cycle (a recursive closure over the parameter map did), or
the originals stay alive, a whole model's worth of memory, until the collector happens to
run: a wrap-time peak that depends on the collector's timing (and live-byte bounds that
moved with it).
"""

from __future__ import annotations

import gc
import weakref

from torch import nn

from mfsdp_collectives.testing import run_distributed
from mfsdp_hooks import FSDPRootWrapper, fully_shard
from mfsdp_hooks.testing import Block, make_model


def _alive_after_wrap(entry: str) -> int:
    """How many of a fresh model's parameters are alive right after wrapping it, with the
    collector off."""
    model = make_model()
    originals = [weakref.ref(p) for p in model.parameters()]
    gc.collect()
    gc.disable()
    try:
        if entry == "per_module":
            for block in model.blocks:
                fully_shard(block)
            wrapped: nn.Module = fully_shard(model)
        else:
            wrapped = FSDPRootWrapper(model, fsdp_unit_modules=[Block])
        return sum(ref() is not None for ref in originals)
    finally:
        gc.enable()
        del wrapped


def _worker(rank: int, world: int) -> dict[str, int]:
    # torch's first DTensor construction imports lazily and keeps that import's frames,
    # with the first unit's arguments, in a cached traceback: one wrap to settle it.
    _alive_after_wrap("per_module")
    return {entry: _alive_after_wrap(entry) for entry in ("per_module", "root_wrapper")}


def test_the_originals_are_freed_when_the_wrap_returns() -> None:
    for alive in run_distributed(_worker, 2, timeout=120):
        assert alive == {"per_module": 0, "root_wrapper": 0}
