"""A Hugging Face Llama wrapped through each entry point, FSDP2's beside: the models of the
host-cost and compile tests (issue 50), which hold ours against FSDP2 on the same model."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

ENTRY_POINTS = ("per_module", "seed", "model_optimizer", "class", "mcore")
"""Ours: per-module ``fully_shard``, ``fully_shard(model, optimizer)``, ``fully_shard_model`` +
``fully_shard_optimizer``, the ``MegatronFSDP`` class + ``fully_shard_optimizer``, the
Megatron-Core adapter (``megatron_fsdp.mcore.FullyShardedDataParallel``, with the configs'
stand-ins) + ``fully_shard_optimizer``."""


def wrap_llama(
    impl: str, model: nn.Module, lr: float, **options: Any
) -> tuple[nn.Module, torch.optim.Optimizer]:
    """``model`` (a ``LlamaForCausalLM``) sharded over every rank by ``impl`` (``fsdp2`` or
    one of :data:`ENTRY_POINTS`), each decoder layer a unit, and its AdamW. ``options``: the
    keywords of ``fully_shard`` (``seed``) or ``fully_shard_model`` (``model_optimizer``)."""
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    import megatron_fsdp

    if options and impl not in ("seed", "model_optimizer"):
        raise ValueError(f"{impl!r} takes no options, got {sorted(options)}")
    world = dist.get_world_size()
    if impl in ("fsdp2", "per_module"):
        from torch.distributed.fsdp import fully_shard as fsdp2_shard

        from mfsdp_hooks import fully_shard as our_shard

        shard: Any = fsdp2_shard if impl == "fsdp2" else our_shard
        mesh = init_device_mesh("cpu", (world,))
        for layer in model.model.layers:  # type: ignore[union-attr]
            shard(layer, mesh=mesh)
        shard(model, mesh=mesh)
        return model, torch.optim.AdamW(model.parameters(), lr=lr)
    units = [LlamaDecoderLayer]
    if impl == "seed":
        adamw = torch.optim.AdamW(model.parameters(), lr=lr)
        return megatron_fsdp.fully_shard(model, adamw, fsdp_unit_modules=units, **options)
    if impl == "model_optimizer":
        wrapped: nn.Module = megatron_fsdp.fully_shard_model(
            model, fsdp_unit_modules=units, **options
        )
    elif impl == "class":
        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp_shard",))
        index = megatron_fsdp.FSDPDistributedIndex(mesh, dp_shard_dim="dp_shard")
        config = megatron_fsdp.DistributedDataParallelConfig(
            data_parallel_sharding_strategy="optim_grads_params",
            overlap_grad_reduce=True,
            overlap_param_gather=True,
        )
        wrapped = megatron_fsdp.MegatronFSDP(model, index, config, fsdp_unit_modules=units)
    elif impl == "mcore":
        from mcore_stand_ins import mcore_chunk

        wrapped = mcore_chunk(model, units)
    else:
        raise ValueError(f"unknown impl {impl!r}")
    adamw = torch.optim.AdamW(wrapped.parameters(), lr=lr)
    return wrapped, megatron_fsdp.fully_shard_optimizer(adamw)
