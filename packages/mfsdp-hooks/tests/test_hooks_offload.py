"""Host offload (FSDP2's ``CPUOffloadPolicy``, ``mfsdp_hooks.config.offload``) on CPU with the
copies forced: the main weights, gradients and optimizer state live in "host" tensors apart
from the "device" buffers the collectives use, every copy between them is made and counted.

Held to: parity with one process (ZeRO-3 at 1 and 2 ranks, HSDP at 4), exactly the results of
the same run without offload under bf16 mixed precision, one host -> device copy per group
gathered and one device -> host copy per group's reduced gradients (and their bytes), the
stream order on simulated streams, and refusals by name.
"""

from __future__ import annotations

import functools
import os
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy

from mfsdp_collectives.testing import run_distributed
from mfsdp_collectives.testing.stream_sim import simulated_streams
from mfsdp_hooks import MixedPrecisionPolicy, fsdp_units
from mfsdp_hooks.api.fsdp2_options import check_offload_policy
from mfsdp_hooks.config.offload import HostOffload
from mfsdp_hooks.config.strategy import ShardingStrategy
from mfsdp_hooks.testing import loss_fn, make_batches, make_model
from mfsdp_hooks.testing.offload import forced_host_copies, offload_counts, reset_offload_counts
from mfsdp_hooks.testing.parity import (
    ParityCase,
    adamw,
    check_parity,
    run_parity,
    shard_blocks,
    trainable,
)

FULL = os.environ.get("MFSDP_FULL_MATRIX") == "1"
_FULL_ONLY = pytest.mark.skipif(not FULL, reason="MFSDP_FULL_MATRIX=1 only")
FP32 = 4  # bytes


def offloaded(model: nn.Module, *, pin_memory: bool = True, **options: Any) -> nn.Module:
    """``shard_blocks`` with ``CPUOffloadPolicy``, the host copies forced."""
    with forced_host_copies():
        return shard_blocks(
            model, offload_policy=CPUOffloadPolicy(pin_memory=pin_memory), **options
        )


def _hsdp(model: nn.Module) -> nn.Module:
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_outer", "dp_shard"))
    return offloaded(model, mesh=mesh)


def _groups(model: nn.Module) -> list[Any]:
    return [group for unit in fsdp_units(model) for group in unit.groups]


def _assert_state_on_the_host(model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """The optimizer-facing weights, their gradients and the optimizer state are the host
    tensors, apart from any buffer the collectives use."""
    for group in _groups(model):
        assert group.offload is not None and group.main is not None
        assert not group.model.has_persistent_shard or not group.model.sharded
        for param in group.dist_params:
            local = param.to_local()
            assert (
                local.untyped_storage().data_ptr() == group.main.shard.untyped_storage().data_ptr()
            )
            if param.grad is not None:
                assert group.reducer.landing is not None
    states = [t for s in optimizer.state.values() for t in s.values() if t.dim() > 0]
    assert states and all(t.device.type == "cpu" for t in states)


def _step(model: nn.Module, optimizer: torch.optim.Optimizer, rank: int, world: int) -> float:
    tokens, targets = (t.chunk(world)[rank] for t in make_batches(1, seed=7)[0])
    loss = loss_fn(model(tokens), targets)
    loss.backward()  # type: ignore[no-untyped-call]
    optimizer.step()
    optimizer.zero_grad()
    return float(loss.detach())


def _counting_worker(rank: int, world: int, reshard: bool | None) -> dict[str, Any]:
    """Parity first, then one step counted."""
    case = ParityCase("zero3", functools.partial(offloaded, reshard_after_forward=reshard))
    model = check_parity(rank, world, case)
    optimizer = adamw(trainable(model))
    _step(model, optimizer, rank, world)  # optimizer state made
    _assert_state_on_the_host(model, optimizer)
    reset_offload_counts(model)
    _step(model, optimizer, rank, world)
    counts = offload_counts(model)
    groups = _groups(model)
    grads = [g for g in groups if g.requires_grad]
    return {
        "counts": (counts.to_device, counts.to_device_bytes, counts.to_host, counts.to_host_bytes),
        "groups": len(groups),
        "gathered_bytes": sum(g.main.shard.numel() * FP32 for g in groups),
        "grad_groups": len(grads),
        "grad_bytes": sum(g.grads.numel * FP32 for g in grads),
        "blocks": sum(g.main.shard.numel() * FP32 for u in fsdp_units(model)[1:] for g in u.groups),
    }


def _bf16_losses(rank: int, world: int, offload: bool) -> list[float]:
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16)
    model = make_model()
    if offload:
        offloaded(model, mp_policy=policy, pin_memory=False)
    else:
        shard_blocks(model, mp_policy=policy)
    optimizer = adamw(trainable(model))
    return [_step(model, optimizer, rank, world) for _ in range(3)]


def _two_rank_worker(rank: int, world: int) -> dict[str, Any]:
    """The 2-rank checks in one world (starting one costs more than a case): ZeRO-3 parity and
    its copies, ZeRO-2 parity, bf16 as without offload, and the stream order on simulated
    streams (the copies on the all-gather and reduce-scatter streams, every buffer they touch
    ordered with the collectives and compute around it)."""
    got = _counting_worker(rank, world, None)
    check_parity(
        rank, world, ParityCase("zero2", functools.partial(offloaded, sharding_strategy=2), steps=4)
    )
    got["bf16"] = (_bf16_losses(rank, world, True), _bf16_losses(rank, world, False))
    with simulated_streams() as simulator:
        check_parity(rank, world, ParityCase("zero3 on streams", offloaded, steps=2))
    got["ticks"] = {s.name: s.tick for s in simulator.streams}
    return got


def test_offload_trains_as_one_process_and_counts_its_copies() -> None:
    # The toy: the root unit (embedding tied to the head, a frozen layer: two groups) and
    # three blocks. Blocks are resharded after forward and gathered again for backward.
    for got in run_distributed(_two_rank_worker, 2, timeout=240):
        to_device, to_device_bytes, to_host, to_host_bytes = got["counts"]
        assert got["groups"] == 5 and got["grad_groups"] == 4
        assert to_device == got["groups"] + 3  # one per group gathered, blocks twice
        assert to_device_bytes == got["gathered_bytes"] + got["blocks"]
        assert (to_host, to_host_bytes) == (got["grad_groups"], got["grad_bytes"])
        offloaded_losses, plain_losses = got["bf16"]
        assert offloaded_losses == plain_losses  # mixed precision as usual, bit for bit
        assert got["ticks"]["all_gather"] > 0 and got["ticks"]["reduce_scatter"] > 0


def test_one_process_one_copy_each_way_per_group_without_reshard_after_forward() -> None:
    (got,) = run_distributed(_counting_worker, 1, False, timeout=120)
    assert got["counts"] == (
        got["groups"],
        got["gathered_bytes"],
        got["grad_groups"],
        got["grad_bytes"],
    )


def test_hsdp_offload_trains_as_one_process() -> None:
    run_parity(4, [ParityCase("hsdp", _hsdp)])


@_FULL_ONLY
def test_zero1_offload_trains_as_one_process() -> None:
    run_parity(2, [ParityCase("zero1", functools.partial(offloaded, sharding_strategy=1))])


def _topology(device: str, *, across_outer: bool = False) -> Any:
    return SimpleNamespace(device=torch.device(device), shards_optimizer_across_outer=across_outer)


def test_offload_policy_is_checked_and_refused_by_name() -> None:
    zero3 = ShardingStrategy.OPTIM_GRADS_PARAMS
    policy = CPUOffloadPolicy(pin_memory=False)
    assert check_offload_policy(policy, _topology("cpu"), zero3) is None  # nothing to move
    offload = check_offload_policy(policy, _topology("cuda"), zero3)
    assert isinstance(offload, HostOffload) and not offload.pin_memory
    with forced_host_copies():
        assert isinstance(check_offload_policy(policy, _topology("cpu"), zero3), HostOffload)
    refusals = [
        (ShardingStrategy.NO_SHARD, False, (), "sharding_strategy=no_shard"),
        (zero3, True, (), "HFSDP"),
        (zero3, False, True, "param_codecs"),
    ]
    for strategy, across, codecs, says in refusals:
        with pytest.raises(ValueError, match=rf"offload_policy=CPUOffloadPolicy\(\) with .*{says}"):
            check_offload_policy(
                policy, _topology("cuda", across_outer=across), strategy, codecs=bool(codecs)
            )
    with pytest.raises(TypeError, match="offload_policy must be"):
        check_offload_policy("cpu", _topology("cuda"), zero3)


def _no_shard_worker(rank: int, world: int) -> None:
    offloaded(make_model(), sharding_strategy=0)


def test_no_shard_offload_is_refused_on_every_rank_before_any_collective() -> None:
    with pytest.raises(Exception, match=r"sharding_strategy=no_shard"):
        run_distributed(_no_shard_worker, 2, timeout=60)
