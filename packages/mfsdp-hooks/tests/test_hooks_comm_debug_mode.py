"""torch's ``CommDebugMode`` counts our collectives as it counts FSDP2's (issue #49, item 3).

Users and torch's own tests count collectives with ``CommDebugMode``: the c10d ops dispatched
on the calling thread. Over the shared-memory host transport (``host_transport="auto"`` on
one host) ours issued none, so the mode counted nothing. Here: blocks and a root, FSDP2's
default ``reshard_after_forward`` (the root keeps its weights for backward), 2 ranks; every
micro-batch's counts under the mode equal our own ``CommTracer``'s and FSDP2's, over shared
memory and over gloo, with and without ``set_requires_gradient_sync(False)``.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor.debug import CommDebugMode

from mfsdp_collectives import CommTracer, host_transport_of
from mfsdp_collectives.testing import run_distributed

WIDTH = 8
MICRO_BATCHES = 2
c10d = torch.ops.c10d


def _model() -> nn.Sequential:
    """A linear for the root, then three two-layer blocks, each sharded on its own."""
    torch.manual_seed(0)
    blocks = [
        nn.Sequential(nn.Linear(WIDTH, 2 * WIDTH), nn.ReLU(), nn.Linear(2 * WIDTH, WIDTH))
        for _ in range(3)
    ]
    return nn.Sequential(nn.Linear(WIDTH, WIDTH), *blocks)


def _shard(model: nn.Sequential, impl: str, transport: str) -> None:
    shard: Any
    if impl == "fsdp2":
        from torch.distributed.fsdp import fully_shard as shard

        options: dict[str, Any] = {}
    else:
        from mfsdp_hooks import fully_shard as shard

        options = {"host_transport": transport}
    for block in list(model)[1:]:
        shard(block, **options)
    shard(model, **options)


def _counted(mode: CommDebugMode) -> tuple[int, int]:
    """(all-gathers, reduce-scatters), under the keys torch's own FSDP2 tests read."""
    counts = mode.get_comm_counts()
    return counts[c10d._allgather_base_], counts[c10d._reduce_scatter_base_]


def _train(impl: str, transport: str, rank: int) -> dict[str, list[Any]]:
    """Two steps of two micro-batches: step 0 syncs both, step 1 accumulates the first
    unsynced. Each micro-batch's counts under the mode and under our tracer."""
    model = _model()
    _shard(model, impl, transport)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    generator = torch.Generator().manual_seed(rank)
    out: dict[str, list[Any]] = {"modes": [], "traced": [], "losses": [], "totals": []}
    for step in range(2):
        for micro in range(MICRO_BATCHES):
            last = micro == MICRO_BATCHES - 1
            model.set_requires_gradient_sync(step == 0 or last)  # type: ignore[operator]
            x = torch.randn(4, WIDTH, generator=generator)
            with CommDebugMode() as mode, CommTracer() as tracer:  # type: ignore[no-untyped-call]
                loss = model(x).square().mean()
                loss.backward()
            out["modes"].append(_counted(mode))
            out["totals"].append(mode.get_total_counts())
            out["traced"].append((tracer.calls("all_gather"), tracer.calls("reduce_scatter")))
            out["losses"].append(loss.item())
        optimizer.step()
        optimizer.zero_grad()
    return out


def _worker(rank: int, world: int, impl: str) -> dict[str, dict[str, list[Any]]]:
    if impl == "fsdp2":
        return {"fsdp2": _train(impl, "", rank)}
    runs = {"gloo": _train(impl, "gloo", rank)}
    runs["auto"] = _train(impl, "auto", rank)
    # the case that was invisible: make sure it ran over shared memory
    assert host_transport_of(dist.group.WORLD) is not None  # type: ignore[arg-type]
    return runs


def test_comm_debug_mode_counts_ours_as_our_tracer_and_as_fsdp2() -> None:
    """Failed before over shared memory ("auto"): the mode counted (0, 0) where our tracer
    and FSDP2 count 7 all-gathers (4 in forward, the 3 blocks again in backward) and 4
    reduce-scatters per synced micro-batch (none in an unsynced one)."""
    ours = run_distributed(_worker, 2, "ours", timeout=120)
    theirs = run_distributed(_worker, 2, "fsdp2", timeout=120)
    synced, unsynced = (7, 4), (7, 0)
    for mine, fsdp2 in zip(ours, theirs, strict=True):
        assert fsdp2["fsdp2"]["modes"] == [synced, synced, unsynced, synced]
        for transport in ("auto", "gloo"):
            run = mine[transport]
            assert (transport, run["modes"]) == (transport, fsdp2["fsdp2"]["modes"])
            assert run["traced"] == run["modes"]
            assert run["losses"] == pytest.approx(fsdp2["fsdp2"]["losses"], rel=1e-5)


def _one_rank_worker(rank: int, world: int) -> tuple[dict[str, list[Any]], dict[str, list[Any]]]:
    return _train("ours", "auto", rank), _train("fsdp2", "", rank)


def test_one_rank_issues_no_collective_as_fsdp2() -> None:
    """Failed before: at world size 1 ours issued each unit's all-gathers and reduce-scatters
    (and the gradient-presence all-reduce) where FSDP2 issues none (torch's
    test_train_parity_single_worldsize1 counts them)."""
    ours, theirs = run_distributed(_one_rank_worker, 1, timeout=60)[0]
    assert theirs["totals"] == [0] * 2 * MICRO_BATCHES
    assert ours["totals"] == theirs["totals"]
    assert ours["traced"] == [(0, 0)] * 2 * MICRO_BATCHES
    assert ours["losses"] == pytest.approx(theirs["losses"], rel=1e-6)
