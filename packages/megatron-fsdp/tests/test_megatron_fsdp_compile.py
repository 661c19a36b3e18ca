"""``torch.compile`` over sharded units (issue 48), per block and of the whole model, through
the seed API and per-module ``fully_shard``.

Our unit hooks gather, swap parameters in and issue collectives: dynamo must run them as
written (as FSDP2's) and compile the modules' forwards between them, reading the units as
FSDP2-managed modules whose parameters are graph inputs. Taken for FSDP1 modules, a unit's
forward compiled nothing, and dynamo traced the hooks' own tensor calls into graphs instead;
the whole model failed at its first forward, tracing the root's scan of ``gc``. Each case
counts the graphs that compute a block, checks that none holds the engine's work and that
nothing recompiles from step to step, and trains 10 steps within 1e-5 of the same wrapped
model run eagerly. The backend is ``aot_eager`` (forward and backward through AOT autograd,
as inductor's, without inductor's cost on CPU).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

from megatron_fsdp import fully_shard
from mfsdp_collectives.testing import run_distributed
from mfsdp_hooks import fully_shard as fully_shard_module
from mfsdp_hooks.testing import Block, make_batches, make_model, train_data_parallel

STEPS = 10
BLOCK_OPS = {"layer_norm", "linear", "tanh", "add"}  # Block.forward, as dynamo records it


class GraphLog:
    """A backend that records the torch calls of each graph dynamo hands it, then compiles
    it with ``aot_eager``."""

    def __init__(self) -> None:
        from torch._dynamo.backends.registry import lookup_backend

        self.graphs: list[list[str]] = []
        self._aot_eager = lookup_backend("aot_eager")

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Callable[..., Any]:
        calls = [n.target for n in gm.graph.nodes if n.op in ("call_function", "call_method")]
        self.graphs.append([getattr(t, "__name__", str(t)) for t in calls])
        return self._aot_eager(gm, example_inputs)


def _wrapped(api: str) -> tuple[nn.Module, nn.Module, torch.optim.Optimizer]:
    """(what the user calls, the model whose blocks are units, its optimizer)."""
    model = make_model()
    if api == "seed":
        trainable = [p for p in model.parameters() if p.requires_grad]
        wrapped, optimizer = fully_shard(
            model, torch.optim.AdamW(trainable, lr=1e-2), fsdp_unit_modules=[Block]
        )
        return wrapped, model, optimizer
    for block in model.blocks:
        fully_shard_module(block)
    fully_shard_module(model)
    trainable = [p for p in model.parameters() if p.requires_grad]
    return model, model, torch.optim.AdamW(trainable, lr=1e-2)


def _train_compiled(rank: int, world: int, api: str, scope: str) -> dict[str, Any]:
    batches = make_batches(STEPS)
    eager, _, eager_optimizer = _wrapped(api)
    want = train_data_parallel(eager, eager_optimizer, batches, rank, world, global_mean=True)

    caller, model, optimizer = _wrapped(api)
    log = GraphLog()
    if scope == "per_block":
        for block in model.blocks:  # type: ignore[union-attr]
            block.compile(backend=log)
    else:
        caller = torch.compile(caller, backend=log)  # type: ignore[assignment]
    got = train_data_parallel(caller, optimizer, batches[:1], rank, world, global_mean=True)
    graphs_after_first_step = len(log.graphs)
    got += train_data_parallel(caller, optimizer, batches[1:], rank, world, global_mean=True)
    return {
        "graphs": log.graphs,
        "graphs_after_first_step": graphs_after_first_step,
        "losses": got,
        "eager_losses": want,
    }


@pytest.mark.parametrize("api", ["seed", "per_module"])
@pytest.mark.parametrize("scope", ["per_block", "whole_model"])
def test_compile_compiles_the_blocks_and_trains_as_eager(scope: str, api: str) -> None:
    for rank, out in enumerate(run_distributed(_train_compiled, 2, api, scope, timeout=240)):
        graphs = out["graphs"]
        block_graphs = [g for g in graphs if set(g) == BLOCK_OPS and g.count("linear") == 2]
        assert block_graphs, f"rank {rank}: no graph computes a block's forward: {graphs}"
        engine_work = [g for g in graphs if not set(g) <= BLOCK_OPS | {"embedding"}]
        assert not engine_work, f"rank {rank}: graphs hold more than the model's compute"
        assert len(graphs) == out["graphs_after_first_step"], f"rank {rank}: recompiled"
        torch.testing.assert_close(
            torch.tensor(out["losses"]), torch.tensor(out["eager_losses"]), rtol=0, atol=1e-5
        )
