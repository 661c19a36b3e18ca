"""The flat buffers a ``ParameterGroup`` is made of, and its parameters pointed at them.

Construction only: which buffers exist for a strategy and mixed-precision policy (compute
weights, main weights, the gradient shard), filling them from the original values, and
turning the user's parameters into views of the unsharded compute buffer.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from mfsdp_buffers import BufferRole, DataParallelBuffer
from mfsdp_hooks.codec import GroupCodec
from mfsdp_hooks.grad_shard import DTensorMaker, GradShard
from mfsdp_hooks.shard_cuts import ShardCuts
from mfsdp_hooks.strategy import ShardingStrategy
from mfsdp_hooks.tensor_parallel import TPSpec, unsharded_param

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
) -> tuple[DataParallelBuffer, DataParallelBuffer | None]:
    """The compute-dtype model weights, and main weights when the optimizer's dtype differs
    (under ZeRO-3 with main weights no compute-dtype shard persists)."""
    topology = cuts.topology
    # HFSDP keeps the compute shard: rebuilding it costs an all-gather across dp_outer.
    rebuilt = strategy.shards_params and optimizer_dtype != compute_dtype
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
    if optimizer_dtype == compute_dtype:
        return model, None
    main = DataParallelBuffer(
        cuts.optim_layout,
        topology.optim_rank,
        dtype=optimizer_dtype,
        device=topology.device,
        role=BufferRole.MAIN_WEIGHT,
        sharded=strategy.shards_optimizer_state,
        name=f"{name}:main",
    )
    return model, main


def grad_shard(
    cuts: ShardCuts,
    strategy: ShardingStrategy,
    name: str,
    *,
    grad_dtype: torch.dtype,
    optimizer_dtype: torch.dtype,
    make_dtensor: DTensorMaker,
) -> GradShard:
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
        device=cuts.topology.device,
        sharded=strategy.shards_optimizer_state,
        make_dtensor=make_dtensor,
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
    """Point the user's parameters at the unsharded buffer, freeing their own storage.

    Keeping the same ``nn.Parameter`` objects preserves every outside reference to them
    (an optimizer built before wrapping, tied weights, user code). A tensor-parallel
    parameter becomes a new DTensor over the buffer (a DTensor's local tensor cannot be
    swapped in place), as FSDP2 replaces its parameters; so does a parameter a codec
    decodes (an FP8 weight over the gathered bytes).
    """
    model.materialize()
    adopted = []
    for index, (param, spec) in enumerate(zip(params, tp_specs, strict=True)):
        view = model.unsharded_view(index)
        if codec is not None:
            param = codec.unsharded_param(index, view)
        elif spec is None or not spec.computes_as_dtensor:
            param.data = view
        else:
            param = unsharded_param(view, spec, requires_grad=param.requires_grad)
        adopted.append(param)
    if model.sharded:
        model.release()
    return adopted
