"""``optimizer_cpu_offload`` through the seed's entry points: ``fully_shard(model, optimizer)``,
``fully_shard_model`` + ``fully_shard_optimizer`` and the ``MegatronFSDP`` class (its
``DistributedDataParallelConfig``). On CPU with the host copies forced
(``mfsdp_hooks.testing.offload``), each trains as one process does, with the main weights,
gradients and optimizer state in host tensors apart from the buffers the collectives use;
the per-module ``fully_shard(offload_policy=...)`` is tested in mfsdp-hooks."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

import megatron_fsdp
from megatron_fsdp import DistributedDataParallelConfig, FSDPDistributedIndex, MegatronFSDP
from mfsdp_collectives.testing import run_distributed
from mfsdp_hooks import fsdp_units
from mfsdp_hooks.testing import Block, make_model
from mfsdp_hooks.testing.offload import forced_host_copies, offloads
from mfsdp_hooks.testing.parity import Pair, ParityCase, run_parity, trainable


def _seed_one_liner(model: nn.Module, optimizer: torch.optim.Optimizer) -> Pair:
    """The one-liner's own optimizer, built on the original parameters, is the one that trains."""
    with forced_host_copies():
        wrapped, optimizer = megatron_fsdp.fully_shard(
            model, optimizer, fsdp_unit_modules=[Block], optimizer_cpu_offload=True
        )
    stepped = [p for group in optimizer.param_groups for p in group["params"]]
    assert stepped and all(p.to_local().device.type == "cpu" for p in stepped)
    assert {id(p) for p in stepped} == {id(p) for p in trainable(wrapped)}
    return _offloading(wrapped), optimizer


def _model_then_optimizer(model: nn.Module) -> nn.Module:
    with forced_host_copies():
        wrapped = megatron_fsdp.fully_shard_model(
            model, fsdp_unit_modules=[Block], optimizer_cpu_offload=True
        )
    return _offloading(wrapped)


def _class(model: nn.Module) -> nn.Module:
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp_shard",))
    index = FSDPDistributedIndex(mesh, dp_shard_dim="dp_shard")
    config = DistributedDataParallelConfig(
        data_parallel_sharding_strategy="optim_grads_params", optimizer_cpu_offload=True
    )
    with forced_host_copies():
        return _offloading(MegatronFSDP(model, index, config, fsdp_unit_modules=[Block]))


def _offloading(model: nn.Module) -> nn.Module:
    """``model``, asserted to keep every unit's optimizer-facing shards on the host."""
    assert len(offloads(model)) == len(fsdp_units(model)) > 1
    return model


def test_seed_entry_points_offload_and_train_as_one_process() -> None:
    run_parity(
        2,
        [
            ParityCase("fully_shard(model, optimizer)", wrap=_seed_one_liner),
            ParityCase(
                "fully_shard_model + fully_shard_optimizer",
                _model_then_optimizer,
                sharded_optimizer=megatron_fsdp.fully_shard_optimizer,
            ),
            ParityCase("MegatronFSDP", _class),
        ],
    )


def _refused(rank: int, world: int, kwargs: dict[str, Any]) -> None:
    with forced_host_copies():
        megatron_fsdp.fully_shard_model(
            make_model(), fsdp_unit_modules=[Block], optimizer_cpu_offload=True, **kwargs
        )


def test_offload_with_no_shard_is_refused_by_name() -> None:
    with pytest.raises(Exception, match=r"CPUOffloadPolicy\(\) with sharding_strategy=no_shard"):
        run_distributed(_refused, 2, {"zero_dp_strategy": 0}, timeout=60)
    with pytest.raises(TypeError, match="optimizer_cpu_offload must be a bool"):
        megatron_fsdp.fully_shard_model(
            make_model(), fsdp_unit_modules=[Block], optimizer_cpu_offload="yes"
        )  # type: ignore[arg-type]
