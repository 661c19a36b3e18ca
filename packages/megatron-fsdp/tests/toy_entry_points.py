"""The toy model (``mfsdp_hooks.testing``) sharded through each entry point, the optimizer
left to the caller: the models of the optimizer-routing tests (non-element-wise, Muon)."""

from __future__ import annotations

from typing import Any

from mcore_stand_ins import TransformerConfigStandIn
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

import megatron_fsdp
from megatron_fsdp import DistributedDataParallelConfig, FSDPDistributedIndex, MegatronFSDP
from megatron_fsdp.mcore import FullyShardedDataParallel
from mfsdp_hooks.testing import Block, make_model
from mfsdp_hooks.testing.parity import shard_blocks


def wrap_toy(entry: str, world: int, **seed_kwargs: Any) -> nn.Module:
    """A fresh toy model sharded through ``entry``: ``per_module``/``per_module_attach``
    (``mfsdp_hooks.fully_shard`` per block, then the root), ``class`` (``MegatronFSDP``),
    ``mcore`` (the Megatron-Core adapter), or else ``fully_shard_model`` (with
    ``seed_kwargs``)."""
    model = make_model()
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


def plain_name(name: str) -> str:
    """A parameter's name in the unwrapped model (the wrappers prefix ``module.``)."""
    return name.rsplit("module.", 1)[-1]
