"""What the host issues per training step (issue 50), ours against torch's FSDP2 on the same
32-layer launch-bound Llama at world size 1: aten ops dispatched, and entries into the
engine (each time torch or the user calls into it: module hooks, autograd hooks and
functions, backward callbacks, optimizer hooks, API calls), the DTensor layer included (each
op of the optimizer's step on DTensor parameters enters Python there).

On a GPU a step of many small layers is bound by what the host issues, not by the device.
Times vary by machine and belong in the benchmark (``benchmarks/RESULTS.md``, launch-bound
rows); counts do not, so a regression shows here on any machine: an op per parameter back
on the hot path (a ``copy_`` per gradient instead of one ``cat`` per unit, a slice per
gradient view), or more hooks than FSDP2 calls.

Counted on the third step (the first two build optimizer state and caches), forward,
backward, optimizer step and ``zero_grad``, through the per-module API, the seed one-liner,
``fully_shard_model`` + ``fully_shard_optimizer`` and the ``MegatronFSDP`` class.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from llama_entry_points import ENTRY_POINTS, wrap_llama
from torch import nn

from mfsdp_collectives.testing import run_distributed
from mfsdp_hooks.testing.host_counts import AtenOpCount, engine_entries, package_dirs

transformers = pytest.importorskip("transformers")

LAYERS = 32


def _llama() -> nn.Module:
    from hf_cases import llama

    return llama(num_hidden_layers=LAYERS, use_cache=False)


def _engine_dirs(impl: str) -> tuple[str, ...]:
    """The implementation's code and the DTensor layer it hands the optimizer: FSDP2's
    parameters run DTensor's dispatcher (C++ calling into its Python on each op), ours run
    ours (``RowShardedDTensor.__torch_dispatch__``) and DTensor's where they fall back."""
    import torch.distributed.tensor as dtensor

    if impl == "fsdp2":
        import torch.distributed.fsdp._fully_shard as fsdp2

        return package_dirs([fsdp2, dtensor])
    import megatron_fsdp
    import mfsdp_buffers
    import mfsdp_checkpoint
    import mfsdp_collectives
    import mfsdp_hooks

    ours = [mfsdp_buffers, mfsdp_collectives, mfsdp_hooks, mfsdp_checkpoint, megatron_fsdp]
    return package_dirs([*ours, dtensor])


def _count(impl: str) -> dict[str, Any]:
    torch.manual_seed(0)
    model, optimizer = wrap_llama(impl, _llama(), lr=1e-3)
    ids = torch.randint(0, 64, (2, 16))

    def step() -> None:
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad()

    step()
    step()
    with AtenOpCount() as counted:
        step()
    entries = engine_entries(step, _engine_dirs(impl))
    return {"ops": counted.ops, "entries": sum(entries.values()), "by_name": dict(entries)}


def _count_all(rank: int, world: int) -> dict[str, dict[str, Any]]:
    return {impl: _count(impl) for impl in ("fsdp2", *ENTRY_POINTS)}


def test_host_issues_no_more_than_fsdp2_per_step() -> None:
    counts = run_distributed(_count_all, 1, timeout=240)[0]
    fsdp2 = counts["fsdp2"]
    for api in ENTRY_POINTS:
        ours = counts[api]
        assert ours["ops"] <= fsdp2["ops"], (api, ours["ops"], fsdp2["ops"])
        assert ours["entries"] <= fsdp2["entries"], (api, ours["by_name"], fsdp2["by_name"])
