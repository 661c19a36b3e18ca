"""``load_state_dict`` of full tensors and torch-sharded DTensors into row-sharded parameters.

``load_state_dict`` ends in ``param.copy_(value)``, a local copy: right only when ``value`` is
laid out as the parameter. What users and torch's helpers hand in instead: full tensors
(``torch.load`` of a full checkpoint), and DTensors cut by ``torch.chunk``
(``distribute_tensor(full, mesh, param.placements)``, what ``set_model_state_dict(...,
full_state_dict=True)`` makes). Each unit's pre-hook (:func:`take_own_rows`, over the
parameters that unit owns) replaces such a value by this rank's rows laid out as the
parameter (a torch-sharded DTensor is gathered first: one collective per tensor, in module
traversal order, the same on every rank); on a ``(dp, tp)`` mesh, rows of torch's own TP
split of the full value. An optimizer's state gets the same (:func:`own_optimizer_rows`):
torch's ``set_optimizer_state_dict(full_state_dict=True)`` without ``broadcast_from_rank0``
hands it ``torch.chunk`` pieces, ``optimizer.load_state_dict`` of a full state dict full
tensors; a step on them would mix two layouts.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, distribute_tensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from mfsdp_hooks.dtensor.dtensor_views import dtensor_like
from mfsdp_hooks.dtensor.row_placement import RowShard
from mfsdp_hooks.dtensor.row_sharded import RowShardedDTensor

__all__ = ["own_optimizer_rows", "own_rows", "take_own_rows"]


def own_rows(value: torch.Tensor, param: RowShardedDTensor, key: str) -> torch.Tensor:
    """``value`` (a full tensor, or a DTensor in any layout torch knows) as this rank's rows
    of ``param``, laid out as ``param``; ``param``'s own layout is returned unchanged.
    Collective over ``value``'s mesh when it is a sharded plain DTensor."""
    if isinstance(value, RowShardedDTensor) and value.dp_row_ranges == param.dp_row_ranges:
        return value
    if tuple(value.shape) != tuple(param.shape):
        return value  # torch reports the size mismatch itself, naming the key
    placements = param.placements
    full = value.full_tensor() if isinstance(value, DTensor) else value
    if not isinstance(placements[0], RowShard):
        return _rows_of_tp_local(full, param, key)
    shape, offset = compute_local_shape_and_global_offset(
        param.shape, param.device_mesh, placements
    )
    slices = tuple(slice(o, o + s) for s, o in zip(shape, offset, strict=True))
    mine = param._local_tensor
    rows = full.detach()[slices].to(device=mine.device, dtype=mine.dtype, copy=True)
    return dtensor_like(rows, param)


def _rows_of_tp_local(full: torch.Tensor, param: RowShardedDTensor, key: str) -> torch.Tensor:
    """This rank's rows of a parameter whose DP rows cut a dim its TP placement cuts too
    (``ColwiseParallel`` under FSDP: FSDP2's ``_StridedShard``): torch's TP split of ``full``
    (local, no communication), then the DP row range of that TP-local tensor."""
    if param.tp_partition_stride != 1:
        raise ValueError(
            f"load_state_dict: {key!r} is a full or torch-sharded tensor, and this parameter's "
            f"TP partition is strided ({param.tp_partition_stride} blocks per rank), which no "
            "torch placement describes: load it through torch.distributed.checkpoint after "
            "mfsdp_checkpoint.enable_dcp(model, optimizer)"
        )
    mesh, dim = param.device_mesh, param.dp_shard_dim
    tp_placements = [Replicate(), *param._spec.placements[1:]]
    tp_local = distribute_tensor(full.detach(), mesh, tp_placements, src_data_rank=None)
    start, end = param.dp_row_ranges[mesh.get_local_rank(0)]
    mine = param._local_tensor
    rows = tp_local.to_local().narrow(dim, start, end - start)
    return dtensor_like(rows.to(device=mine.device, dtype=mine.dtype, copy=True), param)


def take_own_rows(
    state_dict: dict[str, Any], named_params: Iterable[tuple[str, nn.Parameter]]
) -> None:
    """The work of a unit's ``load_state_dict`` pre-hook: each value in ``state_dict`` for
    one of ``named_params`` (keyed as in ``state_dict``) that is row-sharded becomes this
    rank's rows laid out as that parameter (:func:`own_rows`)."""
    for key, param in named_params:
        value = state_dict.get(key)
        if isinstance(param, RowShardedDTensor) and isinstance(value, torch.Tensor):
            state_dict[key] = own_rows(value, param, key)


def own_optimizer_rows(optimizer: torch.optim.Optimizer) -> None:
    """Lay each state tensor of ``optimizer`` out as its row-sharded parameter where it is
    not (a full tensor, or a DTensor cut otherwise). Collective (one
    gather per sharded plain DTensor, in the optimizer's parameter order): every rank of the
    parameters' meshes calls it, with the same optimizer."""
    for group in optimizer.param_groups:
        for param in group["params"]:
            state = optimizer.state.get(param)
            if not isinstance(param, RowShardedDTensor) or not state:
                continue
            for key, value in state.items():
                if isinstance(value, torch.Tensor) and _laid_out_otherwise(value, param):
                    state[key] = own_rows(value, param, f"optimizer state {key!r}")


def _laid_out_otherwise(value: torch.Tensor, param: RowShardedDTensor) -> bool:
    """Whether ``value`` is a tensor of ``param``'s shape not laid out as ``param``: decided on
    what every rank sees alike (type, global shape, ranges), as it decides a collective."""
    if value.dim() == 0 or tuple(value.shape) != tuple(param.shape):
        return False  # a step count, or a factored state: not a copy of the parameter's shape
    return not (isinstance(value, RowShardedDTensor) and value.dp_row_ranges == param.dp_row_ranges)
