"""The reference's class API: ``MegatronFSDP(module, dist_index, ddp_config, ...)``.

Code written for NVIDIA's Megatron-FSDP builds an ``FSDPDistributedIndex`` and a
``DistributedDataParallelConfig``; here the same code trains as one process would, every
config field is honoured or refused, and keywords that contradict the config raise instead
of being dropped.
"""

from __future__ import annotations

import contextlib
from functools import partial
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from megatron_fsdp import (
    DistributedDataParallelConfig,
    FSDPDistributedIndex,
    MegatronFSDP,
    fully_shard_model,
    fully_shard_optimizer,
)
from mfsdp_collectives import CommTracer
from mfsdp_collectives.testing import run_distributed
from mfsdp_hooks.testing import (
    Block,
    local_slice,
    loss_fn,
    make_batches,
    make_model,
    train_single_process,
)
from mfsdp_hooks.testing.parity import ParityCase, run_parity

STEPS = 10


def _index(world: int) -> FSDPDistributedIndex:
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp_shard",))
    return FSDPDistributedIndex(mesh, dp_shard_dim="dp_shard")


def _class_api(model: torch.nn.Module, strategy: str) -> torch.nn.Module:
    config = DistributedDataParallelConfig(
        data_parallel_sharding_strategy=strategy,
        overlap_grad_reduce=True,
        overlap_param_gather=True,
    )
    wrapped = MegatronFSDP(model, _index(dist.get_world_size()), config, fsdp_unit_modules=[Block])
    assert wrapped.ddp_config is config  # Megatron-Core reads the caller's own config back
    return wrapped


def test_the_reference_class_api_trains_as_one_process() -> None:
    strategies = ["optim_grads_params", "optim", "no_shard"]
    cases = [
        ParityCase(s, partial(_class_api, strategy=s), sharded_optimizer=fully_shard_optimizer)
        for s in strategies
    ]
    run_parity(2, cases, timeout=180)


def _refusal_worker(rank: int, world: int, case: str) -> str:
    arguments: dict[str, Any] = {
        "keyword_against_config": {"ddp_config": DistributedDataParallelConfig(), "nccl_ub": True},
        "unsupported_field": {
            "ddp_config": DistributedDataParallelConfig(megatron_fsdp_cuda_graph_mode=True)
        },
        "not_yet_keyword": {"nccl_ub": True},
        "outer_mismatch": {
            "ddp_config": DistributedDataParallelConfig(outer_dp_sharding_strategy="optim")
        },
    }[case]
    try:
        MegatronFSDP(make_model(), _index(world), fsdp_unit_modules=[Block], **arguments)
    except (NotImplementedError, ValueError) as error:
        return f"{type(error).__name__}: {error}"
    return "accepted"


@pytest.mark.parametrize(
    ("case", "expected"),
    [
        ("keyword_against_config", "ValueError: MegatronFSDP keyword(s) ['nccl_ub'] contradict"),
        (
            "unsupported_field",
            "NotImplementedError: DistributedDataParallelConfig.megatron_fsdp_cuda_graph_mode",
        ),
        ("not_yet_keyword", "NotImplementedError: nccl_ub=True"),
        ("outer_mismatch", "ValueError: FSDPDistributedIndex(hsdp_outer_dp_shard=False)"),
    ],
)
def test_what_the_reference_would_drop_or_ours_lacks_raises(case: str, expected: str) -> None:
    for message in run_distributed(_refusal_worker, 2, case, timeout=60):
        assert message.startswith(expected), message


def _methods_worker(rank: int, world: int) -> dict[str, Any]:
    torch.manual_seed(100 + rank)  # ranks start from different weights...
    module = make_model(seed=100 + rank)
    # Megatron-LM's --data-parallel-random-init: wrapping must not refuse the different
    # weights (check_replicas=False) that broadcast_params makes equal afterwards.
    config = DistributedDataParallelConfig(
        data_parallel_sharding_strategy="no_shard", check_replicas=False
    )
    model = MegatronFSDP(module, _index(world), config, fsdp_unit_modules=[Block])
    model.broadcast_params()  # ...until rank 0's are everyone's
    tokens, targets = make_batches(1)[0]
    loss_fn(model(tokens), targets).backward()
    model.finish_grad_sync()
    grads = {
        n: p.grad.to_local().clone() for n, p in model.named_parameters() if p.grad is not None
    }
    model.scale_gradients(0.5)
    halved = all(
        torch.equal(p.grad.to_local(), grads[n] * 0.5)
        for n, p in model.named_parameters()
        if p.grad is not None
    )
    weights = {n: p.full_tensor().tolist() for n, p in model.named_parameters()}
    model.start_param_sync(force_sync=True)
    wrapped = fully_shard_model(make_model(), fsdp_unit_modules=[Block])
    return {
        "weights": weights,
        "halved": halved,
        "same_class": isinstance(wrapped, MegatronFSDP),
    }


def test_broadcast_params_and_scale_gradients() -> None:
    results = run_distributed(_methods_worker, 2, timeout=120)
    assert results[0]["weights"] == results[1]["weights"]
    want = {k.removeprefix("module."): v for k, v in results[0]["weights"].items()}
    rank0 = {n: p.tolist() for n, p in make_model(seed=100).named_parameters()}
    assert want == rank0
    assert all(r["halved"] and r["same_class"] for r in results)


def _accumulate(
    model: MegatronFSDP,
    tokens: torch.Tensor,
    targets: torch.Tensor,
    rank: int,
    world: int,
    *,
    all_under_no_sync: bool,
) -> tuple[float, list[tuple[bool, int]]]:
    """One step of two micro-batches (the first, or both, under ``no_sync``); returns the
    step's loss and (is_last_microbatch, microbatch_count) before and after each backward."""
    seen, total = [], 0.0
    for half in range(2):
        rows = slice(half * tokens.shape[0] // 2, (half + 1) * tokens.shape[0] // 2)
        local = local_slice(tokens[rows], rank, world), local_slice(targets[rows], rank, world)
        synced = half == 1 and not all_under_no_sync
        with contextlib.nullcontext() if synced else model.no_sync():
            seen.append((model.is_last_microbatch, model.microbatch_count))
            loss = loss_fn(model(local[0]), local[1]) / 2
            loss.backward()
            seen.append((model.is_last_microbatch, model.microbatch_count))
        total += loss.item()
    return total, seen


def _accumulation_worker(rank: int, world: int, strategy: str) -> dict[str, Any]:
    config = DistributedDataParallelConfig(data_parallel_sharding_strategy=strategy)
    model = MegatronFSDP(make_model(), _index(world), config, fsdp_unit_modules=[Block])
    optimizer = fully_shard_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-2))
    losses, seen, auto, launched = [], [], [], []
    for step, (tokens, targets) in enumerate(make_batches(STEPS)):
        # Odd steps under sync(): auto-sync on (every backward finishes its reductions).
        with model.sync() if step % 2 else contextlib.nullcontext():
            auto.append(model.model_auto_sync)
            # Every third step both micro-batches run under no_sync and start_grad_sync
            # launches their reductions (Megatron-Core's grad_sync_func); the step waits.
            local = step % 3 == 0
            loss, counts = _accumulate(model, tokens, targets, rank, world, all_under_no_sync=local)
            if local:
                with CommTracer() as tracer:
                    model.start_grad_sync()
                launched.append(tracer.calls("all_reduce") + tracer.calls("reduce_scatter"))
            optimizer.step()
        seen.append([*counts, (model.is_last_microbatch, model.microbatch_count)])
        optimizer.zero_grad()
        total = torch.tensor(loss)
        torch.distributed.all_reduce(total)
        losses.append(total.item() / world)
    return {
        "losses": losses,
        "seen": seen,
        "auto": auto,
        "auto_after": model.model_auto_sync,
        "launched": launched,
    }


@pytest.mark.parametrize("strategy", ["no_shard", "optim_grads_params"])
def test_micro_batches_auto_sync_and_counters_as_the_reference(strategy: str) -> None:
    reference = make_model()
    optimizer = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    want = []
    for tokens, targets in make_batches(STEPS):
        halves = zip(tokens.chunk(2), targets.chunk(2), strict=True)
        losses = [loss_fn(reference(x), y) / 2 for x, y in halves]
        for loss in losses:
            loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        want.append(sum(loss.item() for loss in losses))
    for result in run_distributed(_accumulation_worker, 2, strategy, timeout=180):
        for got, expected in zip(result["losses"], want, strict=True):
            assert abs(got - expected) <= 1e-5 * abs(expected), (result["losses"], want)
        assert result["auto"] == [bool(step % 2) for step in range(STEPS)]
        assert result["auto_after"] is False  # sync() turns it off on exit, as the reference
        # What no_sync kept local is reduced by start_grad_sync, one collective per group
        # (ZeRO-3 reduce-scatters every micro-batch, so nothing is left to launch).
        held = 0 if strategy == "optim_grads_params" else 4  # 3 Blocks + the root
        assert result["launched"] == [held] * len(result["launched"]), result["launched"]
        for step, seen in enumerate(result["seen"]):
            last_synced = step % 3 != 0
            expected = [
                (False, 0),
                (False, 0 if step % 2 else 1),
                (last_synced, 0 if step % 2 else 1),
                (last_synced, 0 if step % 2 else 2),
                (True, 0),  # after the step: finish_grad_sync reset the count
            ]
            assert seen == expected, (step, seen)


def _param_sync_worker(
    rank: int, world: int, strategy: str, gather_in_sync: bool
) -> tuple[list[float], list[int]]:
    """Megatron-Core's loop with a bare optimizer: step, then ``start_param_sync``."""
    config = DistributedDataParallelConfig(
        data_parallel_sharding_strategy=strategy,
        fsdp_all_gather_in_start_param_sync=gather_in_sync,
    )
    model = MegatronFSDP(make_model(), _index(world), config, fsdp_unit_modules=[Block])
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses, gathers = [], []
    for tokens, targets in make_batches(STEPS):
        x, y = local_slice(tokens, rank, world), local_slice(targets, rank, world)
        loss = loss_fn(model(x), y)
        loss.backward()
        model.finish_grad_sync()
        optimizer.step()
        with CommTracer() as tracer:
            model.start_param_sync()
        gathers.append(tracer.calls("all_gather"))
        optimizer.zero_grad()
        total = loss.detach() * x.shape[0]
        torch.distributed.all_reduce(total)
        losses.append(total.item() / tokens.shape[0])
    return losses, gathers


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("strategy", ["optim_grads_params", "optim"])
def test_start_param_sync_may_leave_the_gathers_to_the_forward(world: int, strategy: str) -> None:
    reference = make_model()
    want = train_single_process(
        reference, torch.optim.AdamW(reference.parameters(), lr=1e-2), make_batches(STEPS)
    )
    for gather_in_sync in (True, False):
        for losses, gathers in run_distributed(
            _param_sync_worker, world, strategy, gather_in_sync, timeout=180
        ):
            errors = [abs(a - b) / abs(b) for a, b in zip(losses, want, strict=True)]
            assert max(errors) <= 1e-5, (gather_in_sync, errors)
            # ZeRO-1/2 keep whole compute weights: True gathers the stepped shards into them
            # here, False leaves it to each unit's next forward. ZeRO-3 keeps none between
            # steps: its forward gathers either way.
            if strategy == "optim" and gather_in_sync:
                assert all(g > 0 for g in gathers), gathers
            else:
                assert gathers == [0] * STEPS, gathers
