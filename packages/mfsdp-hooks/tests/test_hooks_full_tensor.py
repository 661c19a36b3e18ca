"""``full_tensor()`` and ``redistribute()`` on distributed parameters and their gradients.

The flat layout cuts parameters where the buffer's shard edges fall (mostly whole parameters
on one rank), not where ``torch.chunk`` would; a plain DTensor over those rows gathers them
into the wrong places. Every dist param and gradient here is compared with the one-process
model after a training step: plain FSDP on 2 and 4 ranks (ZeRO-1..3), HFSDP (optimizer
sharded across dp_outer), and FSDP x TP (2x2, DTensor placements on both dims).
"""

from __future__ import annotations

import pytest
import torch
from hooks_models import (
    Block,
    assert_close_rel,
    hfsdp_topology,
    local_slice,
    loss_fn,
    make_batches,
    make_model,
)
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard

from mfsdp_collectives.testing import run_distributed
from mfsdp_hooks import (
    FSDPRootWrapper,
    RowShardedDTensor,
    ShardingOptions,
    row_sharded,
)
from mfsdp_hooks.dtensor.dtensor_views import sharded_dtensor
from mfsdp_hooks.testing.parity import shard_blocks
from mfsdp_hooks.testing.tp import TP_OUT, TP_WIDTH, full_value, tp_model


def _check_gathers(model: nn.Module, reference: nn.Module, what: str) -> int:
    """Every way of gathering each dist param and gradient gives the reference's values;
    returns how many parameters were not ``torch.chunk``-even (the cases that matter)."""
    ref_params = dict(reference.named_parameters())
    uneven = 0
    for name, param in model.named_parameters():
        want = ref_params[name.removeprefix("module.")]
        assert isinstance(param, DTensor), name
        views = {
            "full_tensor": param.full_tensor(),
            "detach": param.detach().full_tensor(),
            "data": param.data.full_tensor(),
            "clone": param.clone().full_tensor(),
            "replicate": param.redistribute(
                placements=[Replicate()] * param.device_mesh.ndim
            ).to_local(),
        }
        for how, value in views.items():
            assert_close_rel(value, want.detach(), 1e-6, f"{what} {name} {how}")
        if want.grad is not None:
            assert param.grad is not None, name
            assert_close_rel(param.grad.full_tensor(), want.grad, 1e-5, f"{what} {name}.grad")
        if isinstance(param, RowShardedDTensor):
            ranks = len(param.dp_row_ranges)
            rows = [end - start for start, end in param.dp_row_ranges]
            chunked = [len(c) for c in torch.arange(param.shape[0]).chunk(ranks)]
            uneven += rows != chunked + [0] * (ranks - len(chunked))
            assert param.redistribute(placements=param.placements) is param
            # Through Replicate, a Shard(0) with torch.chunk's rows, as torch code expects.
            dp_whole = param.redistribute(placements=[Replicate(), *param.placements[1:]])
            even = dp_whole.redistribute(placements=[Shard(0), *param.placements[1:]])
            assert type(even) is DTensor and not isinstance(even, RowShardedDTensor)
            assert_close_rel(even.full_tensor(), want.detach(), 1e-6, f"{what} {name} even")
    return uneven


def _train_once(model: nn.Module, reference: nn.Module, rank: int, world: int) -> None:
    """One optimizer step of both on the same global batch, then the next batch's gradients
    left in place."""
    batches = make_batches(2, 12)
    for net, share in ((model, (rank, world)), (reference, (0, 1))):
        optimizer = torch.optim.AdamW([p for p in net.parameters() if p.requires_grad], lr=1e-2)
        for step, (tokens, targets) in enumerate(batches):
            optimizer.zero_grad()
            loss_fn(net(local_slice(tokens, *share)), local_slice(targets, *share)).backward()
            if step == 0:
                optimizer.step()


def _fsdp_worker(rank: int, world: int, strategy: int, hfsdp: bool) -> int:
    reference = make_model()
    if hfsdp:
        topology = hfsdp_topology(2, world // 2)
        options = ShardingOptions(device_mesh=topology, sync_model_each_microbatch=False)
        model: nn.Module = FSDPRootWrapper(make_model(), fsdp_unit_modules=[Block], options=options)
    else:
        model = make_model()
        shard_blocks(model, sharding_strategy=strategy)
    _train_once(model, reference, rank, world)
    return _check_gathers(model, reference, f"strategy {strategy} hfsdp={hfsdp}")


@pytest.mark.parametrize(("world", "strategy"), [(2, 3), (4, 3), (4, 2), (2, 1)])
def test_dist_params_and_grads_gather_to_the_one_process_values(world: int, strategy: int) -> None:
    for uneven in run_distributed(_fsdp_worker, world, strategy, False, timeout=180):
        assert uneven > 0  # the layout did cut parameters unlike torch.chunk


def test_hfsdp_dist_params_gather_to_the_one_process_values() -> None:
    for uneven in run_distributed(_fsdp_worker, 4, 3, True, timeout=180):
        assert uneven > 0


def _tp_worker(rank: int, world: int) -> int:
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_shard", "tp"))
    reference = tp_model("mlp", None)
    model = tp_model("mlp", mesh["tp"])
    shard_blocks(model, mesh=mesh["dp_shard"])
    gen = torch.Generator().manual_seed(3)
    x, y = torch.randn(8, 4, TP_WIDTH, generator=gen), torch.randn(8, 4, TP_OUT, generator=gen)
    nn.functional.mse_loss(reference(x), y).backward()
    dp = mesh["dp_shard"].get_local_rank()
    nn.functional.mse_loss(full_value(model(x.chunk(2)[dp])), y.chunk(2)[dp]).backward()
    tp_sharded = [
        p for p in model.parameters() if p.device_mesh.ndim == 2 and p.placements[1] != Replicate()
    ]
    assert len(tp_sharded) == 3 * len(model.blocks)  # colwise weight and bias, rowwise weight
    return _check_gathers(model, reference, "fsdp x tp")


def test_fsdp_x_tp_dist_params_gather_to_the_global_weights() -> None:
    for uneven in run_distributed(_tp_worker, 4, timeout=180):
        assert uneven > 0


def _bad_rows_worker(rank: int, world: int) -> list[str]:
    mesh = init_device_mesh("cpu", (2,))
    local = torch.zeros(3 if rank == 0 else 1, 2)
    tensor = sharded_dtensor(local, mesh, torch.Size([4, 2]))
    errors = []
    cases = [((0, 2), (2, 4)), ((0, 3),), ((0, 3), (3, 4), (4, 4)), ((1, 4), (0, 1))]
    cases.append(((0, 3), (4, 5)))  # row 3 held by no rank
    for ranges in cases:
        try:
            row_sharded(tensor, ranges)
        except ValueError as exc:
            errors.append(str(exc))
    return errors


def test_row_sharded_refuses_counts_that_do_not_match_the_local_rows() -> None:
    for errors in run_distributed(_bad_rows_worker, 2, timeout=60):
        assert len(errors) == 4, errors
        assert "dp_row_ranges gives it rows" in errors[0], errors
        assert "2 ranks" in errors[1] and "2 ranks" in errors[2], errors
        assert "do not tile" in errors[3], errors


def _chunk_rows_worker(rank: int, world: int) -> list[str]:
    """Per case: the class ``row_sharded`` made; ops on it must gather exactly."""
    mesh = init_device_mesh("cpu", (2,))
    full = torch.arange(12.0).view(6, 2)
    ops = (lambda t: torch.zeros_like(t).add_(1), lambda t: t.clone(), lambda t: t * 2 + 1)
    picked = []
    # torch.chunk's rows (3, 3); others (4, 2); all on rank 1 (0, 6).
    for ranges in (((0, 3), (3, 6)), ((0, 4), (4, 6)), ((0, 0), (0, 6))):
        start, end = ranges[rank]
        tensor = row_sharded(sharded_dtensor(full[start:end].clone(), mesh, full.shape), ranges)
        picked.append(type(tensor).__name__)
        for op in ops:
            assert torch.equal(op(tensor).full_tensor(), op(full)), (ranges, op(tensor))
    # torch.chunk of 5 rows (3, 2) and of 1 row (1, 0).
    for rows, ranges in ((5, ((0, 3), (3, 5))), (1, ((0, 1), (1, 1)))):
        start, end = ranges[rank]
        local = torch.zeros(end - start, 2)
        tensor = row_sharded(sharded_dtensor(local, mesh, torch.Size([rows, 2])), ranges)
        picked.append(type(tensor).__name__)
    return picked


def test_row_sharded_keeps_its_rows_with_no_python_torch_function() -> None:
    """Even cuts (``torch.chunk``'s rows) and uneven ones alike: the ops gather exactly, and
    no ``__torch_function__`` of ours runs on each torch call (the optimizer's per-op cost):
    the rows are kept where the ops land, in ``__torch_dispatch__``."""
    for picked in run_distributed(_chunk_rows_worker, 2, timeout=60):
        assert picked == [RowShardedDTensor.__name__] * 5, picked
    assert RowShardedDTensor.__torch_function__ is DTensor.__torch_function__


def _sgd_state_worker(rank: int, world: int) -> None:
    reference, model = make_model(), make_model()
    shard_blocks(model)
    tokens, targets = make_batches(1, 12)[0]
    optimizers = []
    for net, share in ((model, (rank, world)), (reference, (0, 1))):
        trained = [p for p in net.parameters() if p.requires_grad]
        optimizer = torch.optim.SGD(trained, lr=1e-2, momentum=0.9, weight_decay=0.1)
        loss_fn(net(local_slice(tokens, *share)), local_slice(targets, *share)).backward()
        optimizer.step()
        optimizers.append(optimizer)
    ref_params = dict(reference.named_parameters())
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        buffer = optimizers[0].state[param]["momentum_buffer"]
        want = optimizers[1].state[ref_params[name]]["momentum_buffer"]
        assert isinstance(buffer, RowShardedDTensor), f"{name}: {type(buffer).__name__}"
        assert_close_rel(buffer.full_tensor(), want, 1e-5, f"{name} momentum_buffer")


def test_optimizer_state_made_by_an_op_on_a_parameter_keeps_its_rows() -> None:
    """torch's SGD makes its momentum buffer from ``grad.add(param, alpha=weight_decay)``:
    a plain DTensor before, which claimed torch.chunk's rows (full_tensor() and DCP put
    other ranks' values in place)."""
    run_distributed(_sgd_state_worker, 2, timeout=120)
