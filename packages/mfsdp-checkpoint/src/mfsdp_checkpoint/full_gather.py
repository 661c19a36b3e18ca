"""Gather the full (unsharded) state dict to rank 0 on CPU, one parameter group at a time, so no
rank ever holds more than one group's worth of gathered data on the device.
``DTensor.full_tensor()`` cannot do this: it assumes ``torch.chunk`` shards, and the engine's
row shards are uneven.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from mfsdp_checkpoint import _dist
from mfsdp_checkpoint.param_index import ParamIndex, ParamRef
from mfsdp_checkpoint.safetensors_io import TensorSpec, write_safetensors
from mfsdp_checkpoint.wrapper_prefix import rename_model
from mfsdp_hooks import ParameterGroup, ShardingStrategy, local_tensor, tp_full_tensor


@dataclass(frozen=True)
class ExportPlan:
    """The order in which full tensors come out, and under which state-dict names."""

    groups: list[tuple[ParameterGroup, list[tuple[ParamRef, list[str]]]]]
    others: list[str]
    specs: dict[str, TensorSpec]

    @property
    def keys(self) -> list[str]:
        ordered = [k for _, refs in self.groups for _, names in refs for k in names]
        return ordered + self.others


def _out_dtype(dtype: torch.dtype, cast: torch.dtype | None) -> torch.dtype:
    """``cast`` for floating-point tensors when given; other tensors keep their dtype."""
    return cast if cast is not None and dtype.is_floating_point else dtype


def export_plan(model: nn.Module) -> ExportPlan:
    """Names, shapes and dtypes of every full tensor, from local metadata only."""
    index = ParamIndex(model)
    state = model.state_dict()
    by_group: dict[int, list[tuple[ParamRef, list[str]]]] = {}
    specs: dict[str, TensorSpec] = {}
    for ref in index.refs():
        names = [n for n in index.aliases[ref.fqn] if n in state]
        by_group.setdefault(id(ref.group), []).append((ref, names))
        for name in names:
            specs[name] = TensorSpec(name, tuple(ref.param.shape), ref.param.dtype)
    others = [k for k, v in state.items() if k not in specs and isinstance(v, torch.Tensor)]
    for key in others:
        specs[key] = TensorSpec(key, tuple(state[key].shape), state[key].dtype)
    plan = [
        (refs[0][0].group, sorted(refs, key=lambda r: r[0].index)) for refs in by_group.values()
    ]
    return ExportPlan(plan, others, specs)


def _gather_group(group: ParameterGroup, to_all: bool) -> list[torch.Tensor] | None:
    """Every optimizer-facing shard of ``group``, in layout order, on rank 0 of the group
    that holds them (on all its ranks with ``to_all``): the shard group, or under HFSDP the
    ``dp_outer x dp_shard`` group, whose rank order is not sub-shard order."""
    layout = group.optim_layout
    topology = group.topology
    holders, rank, world = topology.optim_group, topology.optim_rank, topology.optim_size
    first = group.dist_params[0]
    assert isinstance(first, DTensor)
    local = local_tensor(first)
    shard = torch.zeros(layout.shard_numel, dtype=first.dtype, device=local.device)
    for index, param in enumerate(group.dist_params):
        piece = layout.local_piece(index, rank)
        if piece.numel:
            start = piece.shard_offset
            flat = layout.placements[index].flatten(local_tensor(param))
            shard[start : start + piece.numel].copy_(flat)
    if world == 1:
        return [shard]
    dst = dist.get_global_rank(holders, 0)
    if not to_all and dist.get_rank(holders) != 0:
        dist.gather(shard, None, dst=dst, group=holders)
        return None
    received = [torch.empty_like(shard) for _ in range(world)]
    if to_all:
        dist.all_gather(received, shard, group=holders)
    else:
        dist.gather(shard, received, dst=dst, group=holders)
    in_layout_order = [received[0]] * world
    for group_rank, tensor in enumerate(received):
        in_layout_order[topology.optim_index_of(group_rank)] = tensor
    return in_layout_order


def _full_param(group: ParameterGroup, index: int, shards: list[torch.Tensor]) -> torch.Tensor:
    layout = group.optim_layout
    pieces = []
    for rank, shard in enumerate(shards):
        piece = layout.local_piece(index, rank)
        if piece.numel:
            pieces.append(shard[piece.shard_offset : piece.shard_offset + piece.numel])
    shape = group.shapes[index]
    if not pieces:
        return torch.zeros(shape, dtype=shards[0].dtype, device=shards[0].device)
    return layout.placements[index].rows_view(torch.cat(pieces)).contiguous()


def _full_value(
    group: ParameterGroup, ref: ParamRef, shards: list[torch.Tensor] | None, receives: bool
) -> torch.Tensor | None:
    """The whole parameter on CPU where it is received (None elsewhere). A tensor-parallel
    one is gathered over TP too, by every rank that holds its full TP-local tensor."""
    spec = group.tp_specs[ref.index]
    if group.strategy == ShardingStrategy.NO_SHARD:
        local: torch.Tensor | None = local_tensor(ref.param).detach()
    else:
        local = _full_param(group, ref.index, shards) if shards else None
    if local is not None and spec is not None:
        local = tp_full_tensor(local, spec)
    return local.to("cpu", copy=True) if local is not None and receives else None


def iter_full_tensors(
    model: nn.Module, plan: ExportPlan, *, to_all: bool = False
) -> Iterator[tuple[str, torch.Tensor | None]]:
    """``(name, full CPU tensor)`` in ``plan.keys`` order; None on ranks that receive nothing.

    Collective: every rank must exhaust the iterator.
    """
    receives = to_all or _dist.rank() == 0
    for group, refs in plan.groups:
        shards = None
        if group.strategy != ShardingStrategy.NO_SHARD:
            shards = _gather_group(group, to_all)
        for ref, names in refs:
            full = _full_value(group, ref, shards, receives)
            for name in names:
                yield name, full
        del shards
    state = model.state_dict()
    for key in plan.others:
        value = state[key]
        if isinstance(value, DTensor):
            value = value.full_tensor()
        yield key, value.detach().to("cpu", copy=True) if receives else None


def gather_full_state_dict(
    model: nn.Module, *, rank0_only: bool = True, dtype: torch.dtype | None = None
) -> dict[str, torch.Tensor]:
    """The unsharded state dict on CPU: on rank 0 (``{}`` elsewhere) or, with
    ``rank0_only=False``, on every rank. Main (fp32) weights; ``dtype`` casts them. Collective.
    Keys and order are those of ``model.state_dict()``; tied weights share one tensor.
    """
    plan = export_plan(model)
    received: dict[str, torch.Tensor] = {}
    for name, tensor in iter_full_tensors(model, plan, to_all=not rank0_only):
        if tensor is not None:
            received[name] = tensor.to(_out_dtype(tensor.dtype, dtype))
    order = list(model.state_dict().keys())
    return {k: received[k] for k in order if k in received}


def save_full_state_dict(
    model: nn.Module,
    path: str | Path,
    *,
    strip_prefix: str = "",
    dtype: torch.dtype | None = None,
) -> None:
    """Write the unsharded model to one safetensors (``.safetensors``) or torch file. Collective.

    safetensors output is streamed group by group, so rank 0 never holds the whole model;
    a torch file has to be built in memory first (``torch.save`` cannot stream).
    ``strip_prefix`` removes a wrapper prefix (``"module."``) so plain models load the file.
    The file's directory is created if it is missing.
    """
    target = Path(path)
    plan = export_plan(model)

    def rename(key: str) -> str:
        return rename_model(key, strip_prefix, "")

    def cast(tensor: torch.Tensor) -> torch.Tensor:
        return tensor.to(_out_dtype(tensor.dtype, dtype))

    stream = iter_full_tensors(model, plan)
    problem: _dist.Problem = None
    if _dist.rank() == 0:
        try:
            target.parent.mkdir(parents=True, exist_ok=True)  # as save_pretrained does
            if target.suffix == ".safetensors":
                specs = [
                    TensorSpec(rename(s.name), s.shape, _out_dtype(s.dtype, dtype))
                    for s in (plan.specs[k] for k in plan.keys)
                ]
                tensors = (cast(t) for _, t in stream if t is not None)
                write_safetensors(target, specs, tensors, {"format": "pt"})
            else:
                received = {k: cast(t) for k, t in stream if t is not None}
                full = {rename(k): received[k] for k in model.state_dict() if k in received}
                tmp = target.with_name(target.name + ".tmp")
                torch.save(full, tmp)
                tmp.replace(target)
        except (OSError, ValueError, TypeError) as error:
            problem = ("CheckpointError", f"writing {target} failed: {error}")
    for _ in stream:  # keep taking part in the collectives whatever happened above
        pass
    _dist.agree(problem)
