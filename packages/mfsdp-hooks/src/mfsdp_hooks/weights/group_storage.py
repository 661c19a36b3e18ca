"""The flat buffers a ``ParameterGroup`` is made of, and its parameters pointed at them.

Construction only: which buffers exist for a strategy and mixed-precision policy (compute
weights, main weights, the gradient shard), filling them from the original values, and
turning the user's parameters into views of the unsharded compute buffer.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from mfsdp_buffers import BufferRole, DataParallelBuffer, mark_host
from mfsdp_hooks.config.codec import GroupCodec
from mfsdp_hooks.config.offload import HostOffload
from mfsdp_hooks.config.strategy import ShardingStrategy
from mfsdp_hooks.dtensor.tensor_parallel import TPSpec, carry_attributes, unsharded_param
from mfsdp_hooks.grads.grad_shard import DTensorMaker, GradShard
from mfsdp_hooks.weights.shard_cuts import ShardCuts

__all__ = ["adopt_params", "check_shardable", "fill_buffers", "grad_shard", "weight_buffers"]


def check_shardable(names: Sequence[str], shapes: Sequence[torch.Size]) -> None:
    for name, shape in zip(names, shapes, strict=True):
        if len(shape) == 0:
            raise ValueError(f"parameter {name!r} is 0-d and cannot be sharded: reshape it to (1,)")


def weight_buffers(
    cuts: ShardCuts,
    strategy: ShardingStrategy,
    name: str,
    *,
    compute_dtype: torch.dtype,
    optimizer_dtype: torch.dtype,
    offload: HostOffload | None = None,
) -> tuple[DataParallelBuffer, DataParallelBuffer | None]:
    """The compute-dtype model weights, and main weights when the optimizer's dtype differs
    or they live on the host (``offload``); under ZeRO-3 with main weights no compute-dtype
    shard persists."""
    topology = cuts.topology
    apart = optimizer_dtype != compute_dtype or offload is not None
    # HFSDP keeps the compute shard: rebuilding it costs an all-gather across dp_outer.
    rebuilt = strategy.shards_params and apart
    model = DataParallelBuffer(
        cuts.layout,
        topology.shard_rank,
        dtype=compute_dtype,
        device=topology.device,
        role=BufferRole.MODEL_WEIGHT,
        sharded=strategy.shards_params,
        name=f"{name}:model",
        persistent_shard=not rebuilt or topology.shards_optimizer_across_outer,
    )
    if not apart:
        return model, None
    main = DataParallelBuffer(
        cuts.optim_layout,
        topology.optim_rank,
        dtype=optimizer_dtype,
        device=topology.device if offload is None else offload.host,
        role=BufferRole.MAIN_WEIGHT,
        sharded=strategy.shards_optimizer_state,
        name=f"{name}:main",
        pin_memory=offload is not None and offload.pin_memory,
    )
    if offload is not None:  # host memory even where the CPU stands in for the device
        mark_host(main.shard)
    return model, main


def grad_shard(
    cuts: ShardCuts,
    strategy: ShardingStrategy,
    name: str,
    *,
    grad_dtype: torch.dtype,
    optimizer_dtype: torch.dtype,
    make_dtensor: DTensorMaker,
    attribute: str = "grad",
    offload: HostOffload | None = None,
) -> GradShard:
    """The reduced gradients, where the optimizer steps: on the host under ``offload``."""
    if grad_dtype != optimizer_dtype:
        raise NotImplementedError(
            f"MixedPrecisionPolicy.main_grads_dtype={grad_dtype} differs from the "
            f"optimizer weights' dtype {optimizer_dtype} for {name!r}: optimizers "
            "need gradients in the dtype of their parameters; leave main_grads_dtype None"
        )
    return GradShard(
        cuts.optim_layout,
        cuts.topology.optim_rank,
        dtype=grad_dtype,
        device=cuts.topology.device if offload is None else offload.host,
        sharded=strategy.shards_optimizer_state,
        make_dtensor=make_dtensor,
        attribute=attribute,
        pin_memory=offload is not None and offload.pin_memory,
        host=offload is not None,
    )


def fill_buffers(
    model: DataParallelBuffer,
    main: DataParallelBuffer | None,
    values: Sequence[torch.Tensor],
    *,
    encoded: bool,
) -> None:
    """Copy the original values in: into main weights, and into the compute weights where
    they persist, unless they are ``encoded`` (a bound codec's: the first gather or install
    makes them)."""
    with torch.no_grad():
        if model.has_persistent_shard and not encoded:
            model.copy_params_in(values)
        if main is not None:
            main.copy_params_in(values)


def adopt_params(
    model: DataParallelBuffer,
    params: Sequence[nn.Parameter],
    tp_specs: Sequence[TPSpec | None],
    codec: GroupCodec | None,
) -> list[nn.Parameter]:
    """The parameters forward and backward see: new ``nn.Parameter`` objects over views of
    the unsharded buffer (a DTensor on the TP mesh for tensor-parallel ones, a codec's
    decoded weight for claimed ones), with the originals' public attributes.

    The user's original parameters are left as they are, as FSDP2 leaves them: a reference
    kept from before sharding reads its stale values (the unsharded buffer's storage is
    freed between uses, so a view of it could not be read safely), and its memory goes once
    nobody holds it. ``lookup.dist_param_of(original)`` names its replacement.
    """
    model.materialize()
    adopted = []
    for index, (param, spec) in enumerate(zip(params, tp_specs, strict=True)):
        view = model.unsharded_view(index)
        if codec is not None:
            unsharded = codec.unsharded_param(index, view)
        elif spec is None or not spec.computes_as_dtensor:
            # ``.data``: a version counter of its own, as ``param.data = view`` gave, so
            # gathering into the buffer again does not look like an in-place edit of a
            # tensor autograd saved
            unsharded = nn.Parameter(view.data, requires_grad=param.requires_grad)
        else:
            unsharded = unsharded_param(view, spec, requires_grad=param.requires_grad)
        carry_attributes(param, unsharded)
        adopted.append(unsharded)
    if model.sharded:
        model.release()
    return adopted
