"""The toy model (``mfsdp_hooks.testing``) sharded through each entry point, with the caller's
optimizer: the models of the tests that run one check through every entry point (optimizer
routing, Muon, the optimizer state's key order, DDP's refusal)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from mcore_stand_ins import TransformerConfigStandIn
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

import megatron_fsdp
import mfsdp_hooks
from megatron_fsdp import DistributedDataParallelConfig, FSDPDistributedIndex, MegatronFSDP
from megatron_fsdp.mcore import FullyShardedDataParallel
from mfsdp_hooks.testing import Block, make_model
from mfsdp_hooks.testing.parity import shard_blocks


def wrap_toy(entry: str, world: int, *, model_seed: int = 0, **seed_kwargs: Any) -> nn.Module:
    """A fresh toy model (``make_model(model_seed)``) sharded through ``entry``:
    ``per_module``/``per_module_attach`` (``mfsdp_hooks.fully_shard`` per block, then the
    root), ``class`` (``MegatronFSDP``), ``mcore`` (the Megatron-Core adapter), or else
    ``fully_shard_model`` (with ``seed_kwargs``)."""
    model = make_model(model_seed)
    if entry in ("per_module", "per_module_attach"):
        sharded: nn.Module = shard_blocks(model)
        return sharded
    if entry == "class":
        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp_shard",))
        index = FSDPDistributedIndex(mesh, dp_shard_dim="dp_shard")
        return MegatronFSDP(model, index, fsdp_unit_modules=[Block])
    if entry == "mcore":
        config = DistributedDataParallelConfig(data_parallel_sharding_strategy="optim_grads_params")
        return FullyShardedDataParallel(TransformerConfigStandIn(), config, model, [Block])
    return megatron_fsdp.fully_shard_model(model, fsdp_unit_modules=[Block], **seed_kwargs)


def shard_toy(
    entry: str,
    world: int,
    optimizer: Callable[[nn.Module], torch.optim.Optimizer],
    *,
    hand_over: bool = True,
    model_seed: int = 0,
    **seed_kwargs: Any,
) -> tuple[nn.Module, torch.optim.Optimizer]:
    """``seed`` (``megatron_fsdp.fully_shard(model, optimizer(model))`` with ``seed_kwargs``)
    or :func:`wrap_toy`'s model, and ``optimizer`` built on it. ``hand_over``: as users of the
    entry point hand it over (``fully_shard_optimizer`` after ``fully_shard_optimizer``,
    ``class`` or ``mcore``, ``attach_optimizer`` after ``per_module_attach``); else the
    engine is left to find it at the first forward."""
    if entry == "seed":
        model = make_model(model_seed)
        return megatron_fsdp.fully_shard(
            model, optimizer(model), fsdp_unit_modules=[Block], **seed_kwargs
        )
    wrapped = wrap_toy(entry, world, model_seed=model_seed, **seed_kwargs)
    built = optimizer(wrapped)
    if hand_over and entry in ("fully_shard_optimizer", "class", "mcore"):
        megatron_fsdp.fully_shard_optimizer(built)
    elif hand_over and entry == "per_module_attach":
        mfsdp_hooks.attach_optimizer(built)
    return wrapped, built


def plain_name(name: str) -> str:
    """A parameter's name in the unwrapped model (the wrappers prefix ``module.``)."""
    return name.rsplit("module.", 1)[-1]
