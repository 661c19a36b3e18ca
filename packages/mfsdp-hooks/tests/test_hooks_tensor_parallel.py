"""FSDP x TP: a model parallelised with torch's DTensor TP, then fully sharded over DP.

Four gloo ranks as a (dp_shard=2, tp=2) mesh train exactly as one process on the global
batch: colwise/rowwise linears, a sequence-parallel LayerNorm, and a plain (TP-replicated)
head in the same model. The optimizer sees DTensors on the 2-D (dp, tp) mesh; the DP
reduce-scatter moves the TP-local bytes only and never runs over the TP group.
"""

from __future__ import annotations

from functools import partial

import pytest
import torch
import torch.distributed as dist
from hooks_models import full_state, shard_blocks
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard

from mfsdp_collectives import CommTracer
from mfsdp_collectives.testing import run_distributed
from mfsdp_hooks import fsdp_units, fully_shard
from mfsdp_hooks.testing.parity import ParityCase, run_parity
from mfsdp_hooks.testing.tp import TP_OUT, TP_WIDTH, full_value, sequence_shard, tp_model


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    return torch.randn(8, 4, TP_WIDTH, generator=gen), torch.randn(8, 4, TP_OUT, generator=gen)


def _batches(n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    tokens, targets = _batch()
    return [(tokens + index, targets) for index in range(n)]


def _fsdp_x_tp(fresh: nn.Module, kind: str, strategy: int, hsdp: bool, meta: bool) -> nn.Module:
    """``hsdp``: a (dp_outer=2, dp_shard=1, tp=2) mesh, FSDP over the 2-D (dp_outer, dp_shard)
    one. ``meta``: the model is built on the meta device, sharded, given storage by
    ``to_empty`` and loaded with ``fresh``'s weights by torch's ``set_model_state_dict``."""
    if hsdp:
        mesh = init_device_mesh("cpu", (2, 1, 2), mesh_dim_names=("dp_outer", "dp_shard", "tp"))
        dp_mesh = mesh["dp_outer", "dp_shard"]
    else:
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_shard", "tp"))
        dp_mesh = mesh["dp_shard"]
    model = shard_blocks(
        tp_model(kind, mesh["tp"], meta=meta), mesh=dp_mesh, sharding_strategy=strategy
    )
    if meta:  # FSDP2's contract: storage, then the user's weights (torch's loader)
        model.to_empty(device="cpu")
        full = StateDictOptions(full_state_dict=True)
        set_model_state_dict(model, fresh.state_dict(), options=full)
    for name, param in model.named_parameters():
        assert isinstance(param, DTensor), name
        if "blocks" in name:  # TP parameters: rows over dp, the TP placement over tp
            assert param.device_mesh.mesh_dim_names == ("dp_shard", "tp"), name
            assert param.placements[0] in (Shard(0), Replicate()), name
    return model


def _sequence_parallel(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """Sequence parallelism's input: this TP rank's shard of the sequence."""
    tp_mesh = model.blocks[0].up.weight.device_mesh["tp"]  # type: ignore[index, union-attr]
    return full_value(model(sequence_shard(x, tp_mesh)))


def _tp_case(
    kind: str, strategy: int, accumulate: bool = False, hsdp: bool = False, meta: bool = False
) -> ParityCase:
    """``accumulate``: each step is two micro-batches, the first under ``no_sync``."""
    return ParityCase(
        f"{kind} strategy={strategy} accumulate={accumulate} hsdp={hsdp} meta={meta}",
        partial(_fsdp_x_tp, kind=kind, strategy=strategy, hsdp=hsdp, meta=meta),
        model=partial(tp_model, kind, None),
        optimizer=partial(torch.optim.AdamW, lr=1e-2, foreach=False),
        batches=_batches,
        loss=nn.functional.mse_loss,
        micro=2 if accumulate else 1,
        share=2,  # the TP pair takes one share
        forward=_sequence_parallel if kind == "sp" else None,
        weights=full_state,
    )


def test_fsdp_x_tp_trains_as_one_process() -> None:
    cases = [_tp_case("mlp", 3), _tp_case("mlp", 2), _tp_case("mlp", 1), _tp_case("sp", 3)]
    run_parity(4, cases)


def test_hsdp_x_tp_trains_as_one_process() -> None:
    run_parity(4, [_tp_case("mlp", 3, accumulate=True, hsdp=True)])


def test_fsdp_x_tp_trains_as_one_process_with_gradient_accumulation() -> None:
    run_parity(4, [_tp_case("mlp", 3, accumulate=True), _tp_case("sp", 2, accumulate=True)])


def _comm_worker(rank: int, world: int) -> tuple[dict[str, dict[str, int]], list[int], bool]:
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_shard", "tp"))
    model = tp_model("mlp", mesh["tp"])
    shard_blocks(model, mesh=mesh["dp_shard"])
    tokens, targets = _batch()
    dp_rank = mesh["dp_shard"].get_local_rank()
    for _ in range(2):  # the first records the prefetch order
        with CommTracer() as tracer:
            out = model(tokens.chunk(2)[dp_rank])
            nn.functional.mse_loss(out, targets.chunk(2)[dp_rank]).backward()
    groups = [g for u in fsdp_units(model) for g in u.groups if g.requires_grad]
    tp_unit = fsdp_units(model.blocks[0])[0]  # type: ignore[index]
    # Colwise weight and bias, rowwise weight: halves; the rowwise bias: whole.
    tp_local = tp_unit.groups[0].layout.data_numel == 8 * 16 + 16 // 2 + 8
    return tracer.summary(), [g.layout.padded_numel for g in groups], tp_local


def test_the_dp_reduce_scatter_moves_tp_local_bytes_and_never_spans_tp() -> None:
    for summary, padded, tp_local in run_distributed(_comm_worker, 4, timeout=120):
        # Each block's buffer holds its TP-local half (colwise weight and bias, rowwise
        # weight) plus the replicated rowwise bias; fp32 gradients cross dp_shard once.
        assert tp_local
        assert summary["dp_shard/reduce_scatter"] == {
            "calls": len(padded),
            "bytes": 4 * sum(padded),
        }
        dp_keys = {k for k in summary if not k.startswith("dp_shard/")}
        assert dp_keys == set(), summary  # no FSDP collective on any other group


def _bad_tp_worker(rank: int, world: int, case: str) -> str:
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_shard", "tp"))
    model = tp_model("mlp", mesh["tp"])
    dp_mesh = mesh["dp_shard"]
    if case == "2d_param":  # a parameter already sharded over both dims
        from torch.distributed.tensor import distribute_tensor

        weight = model.head.weight
        model.head.weight = nn.Parameter(
            distribute_tensor(weight.detach(), mesh, [Replicate(), Shard(0)])
        )
    elif case == "same_mesh":  # FSDP over the TP dim itself
        dp_mesh = mesh["tp"]
    options = {}
    if case == "shard_dim_1":  # FSDP2's shard_placement_fn along dim 1 of TP parameters
        options["shard_placement_fn"] = lambda p: Shard(1) if p.dim() > 1 else None
    try:
        fully_shard(model, mesh=dp_mesh, **options)
    except (ValueError, NotImplementedError) as error:
        dist.barrier()  # every rank got here on its own: nothing was communicated
        return f"{type(error).__name__}: {error}"
    return "no error"


@pytest.mark.parametrize(
    ("case", "expected"),
    [
        ("2d_param", "NotImplementedError: fully_shard(TPModel): tensor-parallel parameter(s)"),
        ("same_mesh", "ValueError: the DP mesh and the TP mesh"),
        ("shard_dim_1", "NotImplementedError: shard_placement_fn returned Shard(dim=1) for"),
    ],
)
def test_tp_parameters_the_engine_cannot_shard_are_refused_on_every_rank(
    case: str, expected: str
) -> None:
    messages = run_distributed(_bad_tp_worker, 4, case, timeout=60)
    assert all(m.startswith(expected) for m in messages), messages


def test_meta_device_tp_model_loads_and_trains_as_the_one_process_model() -> None:
    # Built on meta, TP-parallelised, sharded, to_empty, loaded: the one-process model's
    # values, then its training.
    run_parity(4, [_tp_case("mlp", 3, meta=True), _tp_case("sp", 3, meta=True)])


def _reduce_dtype_worker(rank: int, world: int) -> tuple[dict[str, dict[str, int]], list[int]]:
    from mfsdp_hooks import MixedPrecisionPolicy

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_shard", "tp"))
    policy = MixedPrecisionPolicy(reduce_dtype=torch.bfloat16)
    model = tp_model("mlp", mesh["tp"])
    shard_blocks(model, mesh=mesh["dp_shard"], mp_policy=policy)
    tokens, targets = _batch()
    dp_rank = mesh["dp_shard"].get_local_rank()
    with CommTracer() as tracer:
        out = model(tokens.chunk(2)[dp_rank])
        nn.functional.mse_loss(out, targets.chunk(2)[dp_rank]).backward()
    groups = [g for u in fsdp_units(model) for g in u.groups if g.requires_grad]
    return tracer.summary(), [g.layout.padded_numel for g in groups]


def test_reduce_dtype_applies_to_tp_replicated_parameters_too() -> None:
    # Each block's group holds TP-sharded weights and the TP-replicated rowwise bias; every
    # group reduces in bf16: 2 bytes per element (FSDP2 misses this: pytorch/pytorch#190626).
    for summary, padded in run_distributed(_reduce_dtype_worker, 4, timeout=120):
        assert summary["dp_shard/reduce_scatter"] == {
            "calls": len(padded),
            "bytes": 2 * sum(padded),
        }
