"""FSDP2's per-unit options that take more than a type check, checked before any collective:
``reshard_after_forward`` (an int: the smaller group weights are kept over between forward
and backward), ``offload_policy`` (host offload, ``config.offload``) and
``shard_placement_fn``."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy
from torch.distributed.tensor import Shard

from mfsdp_collectives import FSDPTopology, check_post_forward_size
from mfsdp_hooks.config.offload import HostOffload, host_copies_forced
from mfsdp_hooks.config.strategy import ShardingStrategy
from mfsdp_hooks.dtensor.tensor_parallel import tp_spec_of
from mfsdp_hooks.runtime.slots import SlotMap

__all__ = ["check_offload_policy", "check_reshard_after_forward", "check_shard_placements"]


def check_reshard_after_forward(
    value: bool | int | None, shard_size: int
) -> tuple[bool | None, int | None]:
    """FSDP2's ``reshard_after_forward``: None, a bool, or an int, the number of consecutive
    ranks of the shard group that hold a unit's weights between forward and backward (1 is
    False, as in FSDP2, with a warning; the shard group's size is True). Returns the bool
    and the smaller group's size, if any."""
    if value is None or isinstance(value, bool):
        return value, None
    size = check_post_forward_size(value, shard_size, "reshard_after_forward")
    if size == 1:
        warnings.warn(
            "reshard_after_forward=1 (int) keeps every unit's weights unsharded from forward "
            "to backward, as reshard_after_forward=False does; pass False to say so",
            stacklevel=3,
        )
        return False, None
    return True, None if size == shard_size else size


def check_offload_policy(
    policy: object, topology: FSDPTopology, strategy: ShardingStrategy, *, codecs: bool = False
) -> HostOffload | None:
    """FSDP2's offload policies (``config.offload``) as our offload, or None (also on CPU,
    where nothing moves, unless a test forces the copies). ``codecs``: claiming codecs
    (float8 weights) claimed a parameter."""
    if policy is None or type(policy) is OffloadPolicy:
        return None
    if not isinstance(policy, CPUOffloadPolicy):
        raise TypeError(
            f"offload_policy must be torch.distributed.fsdp.OffloadPolicy or CPUOffloadPolicy, "
            f"got {type(policy).__name__}"
        )
    if topology.device.type == "cpu" and not host_copies_forced():
        return None
    named = "offload_policy=CPUOffloadPolicy() with {}"
    if strategy == ShardingStrategy.NO_SHARD:
        raise ValueError(
            named.format("sharding_strategy=no_shard")
            + ": nothing is sharded, so every rank would keep the whole model on the host and "
            "copy all of it each step; pass sharding_strategy 1, 2 or 3 (optim, optim_grads, "
            "optim_grads_params), or leave offload_policy None"
        )
    if topology.shards_optimizer_across_outer:
        raise ValueError(
            named.format("the optimizer sharded across dp_outer (HFSDP)")
            + " is not supported: replicate across dp_outer (outer strategy no_shard, HSDP) "
            "or leave offload_policy None"
        )
    if codecs:
        raise ValueError(
            named.format("param_codecs")
            + " (float8 weights) is not supported yet: leave one of the two out"
        )
    return HostOffload(topology.device, pin_memory=policy.pin_memory)


def check_shard_placements(
    fn: Callable[[nn.Parameter], Any] | None,
    slots: SlotMap,
    claimed: Callable[[nn.Parameter], bool] = lambda p: False,
    tp_mesh: DeviceMesh | None = None,
) -> tuple[tuple[str, int], ...]:
    """FSDP2's ``shard_placement_fn``: each parameter's ``Shard(dim)`` (None: dim 0). Returns
    ``(name, dim)`` of those cut along another dim than 0, which the layout stores with that
    dim first. Tensor-parallel parameters and ones a codec ``claimed`` (float8 weights) are
    cut along dim 0 only. It is asked before any collective."""
    if fn is None:
        return ()
    if not callable(fn):
        raise TypeError(f"shard_placement_fn must be callable, got {type(fn).__name__}")
    dims = []
    for param, name, _ in slots.values():
        placement = fn(param)
        if placement is None:
            continue
        if type(placement) is not Shard or not -param.dim() <= placement.dim < param.dim():
            raise ValueError(
                f"shard_placement_fn returned {placement!r} for {name!r} of shape "
                f"{tuple(param.shape)}: return Shard(d) for one of its dims, or None (dim 0)"
            )
        dim = placement.dim % param.dim()
        if dim == 0:
            continue
        tensor_parallel = tp_spec_of(param, tp_mesh) is not None
        if tensor_parallel or claimed(param):
            kind = "a tensor-parallel" if tensor_parallel else "a codec-claimed"
            raise NotImplementedError(
                f"shard_placement_fn returned {placement!r} for {name!r}, {kind} parameter: "
                "those are sharded along dim 0 only so far; return Shard(0) or None for it"
            )
        dims.append((name, dim))
    return tuple(dims)
