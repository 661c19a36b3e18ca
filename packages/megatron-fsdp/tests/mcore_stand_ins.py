"""Megatron-Core's configs and its loop's step, without a megatron-core dependency.

``TransformerConfigStandIn`` and ``MCoreDDPConfigStandIn`` are dataclasses with Megatron-Core's
field names and defaults (including fields megatron-fsdp's config does not have), as
``megatron_fsdp.mcore.FullyShardedDataParallel`` receives them from Megatron-Core; they carry
the fields the tests here set or the adapter reads. ``mcore_chunk`` wraps a module as
Megatron-Core wraps a model chunk; ``mcore_step`` takes one step as its training loop does.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from megatron_fsdp.mcore import FullyShardedDataParallel


@dataclass
class TransformerConfigStandIn:
    """The ``TransformerConfig`` fields the adapter reads, with Megatron-Core's defaults."""

    tensor_model_parallel_size: int = 1
    pipeline_model_parallel_size: int = 1
    context_parallel_size: int = 1
    expert_model_parallel_size: int = 1
    num_moe_experts: int | None = None
    expert_tensor_parallel_size: int | None = None
    calculate_per_token_loss: bool = False
    init_model_with_meta_device: bool = False


@dataclass
class MCoreDDPConfigStandIn:
    """Megatron-Core's ``DistributedDataParallelConfig``: shared fields and its own."""

    data_parallel_sharding_strategy: str = "no_shard"
    outer_dp_sharding_strategy: str = "no_shard"
    num_distributed_optimizer_instances: int = 1
    overlap_grad_reduce: bool = False
    overlap_param_gather: bool = False
    use_distributed_optimizer: bool = False
    use_megatron_fsdp: bool = False
    grad_reduce_in_fp32: bool = False
    num_buckets: int | None = None
    align_param_gather: bool = False
    megatron_fsdp_version: int = 1
    megatron_fsdp_use_decoupled_grad: bool = False
    fp8_param_gather: bool = False
    megatron_fsdp_enable_fine_grained_param_gather: bool = False
    bucket_size: int | None = None
    suggested_communication_unit_size: int | None = None
    fsdp_double_buffer: bool = False
    fsdp_db_use_persist_buf_on_alloc_fail: bool = False


def mcore_chunk(module: nn.Module, units: list[type[nn.Module]], **fields: Any) -> Any:
    """``module`` as Megatron-Core wraps a model chunk: ZeRO-3 with the distributed optimizer,
    overlapped reductions and gathers, and ``fields`` of its DDP config."""
    ddp_config = MCoreDDPConfigStandIn(
        data_parallel_sharding_strategy="optim_grads_params",
        overlap_grad_reduce=True,
        overlap_param_gather=True,
        use_distributed_optimizer=True,
        use_megatron_fsdp=True,
        **fields,
    )
    config = TransformerConfigStandIn()
    return FullyShardedDataParallel(config, ddp_config, module, fsdp_unit_modules=units)


def mcore_step(
    chunk: Any,
    optimizer: torch.optim.Optimizer,
    loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    x: torch.Tensor,
    y: torch.Tensor,
) -> None:
    """One step as Megatron-Core's loop takes it: buffers zeroed, ``loss(chunk(x), y)``'s
    backward, ``finish_grad_sync``, the step, the main weights copied to the model weights
    and the next gather started."""
    chunk.zero_grad_buffer()
    optimizer.zero_grad()
    loss(chunk(x), y).backward()
    chunk.finish_grad_sync(force_all_reduce=False)
    optimizer.step()
    chunk.param_and_grad_buffer.copy_main_weights_to_model_weights()
    chunk.start_param_sync()
