"""``describe(model)``, ``FSDPModule.describe_sharding()``: what sharding made of a model,
parameter group by group, on this rank (the package README's "What did sharding make of my
model?"). The bytes a group holds, by category:

* ``compute_weights``: the compute-dtype weights held between steps (the whole buffer under
  ZeRO-0/1/2; this rank's shard under ZeRO-3; none when ZeRO-3 rebuilds them from main
  weights of another dtype before each gather).
* ``main_weights``: the optimizer's weights when their dtype differs from the compute dtype.
* ``gradients``: the reduced gradient this rank keeps while ``.grad`` holds it (the shard
  its optimizer steps under ZeRO-1/2/3, the whole buffer under ZeRO-0).
* ``optimizer_state``: the state tensors of ``optimizer`` for the group's parameters (0 with
  no optimizer, or before its first step).
* ``gathered_weights``: the unsharded compute weights that exist only while the unit is
  gathered (ZeRO-3), not between steps.

With host offload (``CPUOffloadPolicy``, ``optimizer_cpu_offload``) the main weights, the
gradients and the optimizer state live on the host: ``host_bytes`` says, by category, how
many of a group's bytes are there, read off the buffers themselves
(``mfsdp_buffers.residence``); the rest are on the device (``device_bytes``), and the table
marks them ``host``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass

import torch
from torch import nn

from mfsdp_buffers import DataParallelBuffer, on_host
from mfsdp_hooks.dtensor.dtensor_views import local_tensor
from mfsdp_hooks.runtime.observe import format_bytes, group_bytes_per_rank, held_bytes
from mfsdp_hooks.runtime.root import unit_paths
from mfsdp_hooks.weights.param_group import ParameterGroup

__all__ = [
    "CATEGORIES",
    "MODEL_STATE_CATEGORIES",
    "GroupSummary",
    "ShardingSummary",
    "describe",
    "heaviest_rank",
]

MODEL_STATE_CATEGORIES = ("compute_weights", "main_weights", "gradients", "optimizer_state")
"""The categories held from one step to the next (``megatron_fsdp.plan`` plans the same)."""
CATEGORIES = (*MODEL_STATE_CATEGORIES, "gathered_weights")
"""What ``describe`` reports: the model states and the transient ``gathered_weights``."""
_NONE: Mapping[str, int] = dict.fromkeys(CATEGORIES, 0)


@dataclass(frozen=True)
class GroupSummary:
    """One parameter group on this rank; ``bytes`` by category (see the module docstring)."""

    unit: str
    """The unit's module path in the described model (``""`` for its root)."""
    unit_class: str
    params: tuple[str, ...]
    numel: int
    """Elements of the group's parameters, whole (every rank's together, no padding)."""
    padded_numel: int
    """Elements of the flat buffer the parameters are packed into, padding included."""
    requires_grad: bool
    strategy: str
    mesh: str
    gather_dtype: torch.dtype
    """What the all-gather carries (the compute dtype, or a codec's wire dtype)."""
    reduce_dtype: torch.dtype | None
    """What the gradient reduction carries (None for frozen parameters)."""
    bytes: Mapping[str, int]
    host_bytes: Mapping[str, int] = dataclasses.field(default_factory=lambda: _NONE)
    """Of ``bytes``, those on the host (host offload), by category."""

    @property
    def device_bytes(self) -> dict[str, int]:
        """Of ``bytes``, those on the device, by category."""
        return {c: self.bytes[c] - self.host_bytes[c] for c in CATEGORIES}

    @property
    def between_steps_bytes(self) -> int:
        return sum(self.bytes[c] for c in MODEL_STATE_CATEGORIES)


@dataclass(frozen=True)
class ShardingSummary:
    """Every parameter group of a model on ``rank``; ``str()`` is a table."""

    rank: int
    world_size: int
    groups: tuple[GroupSummary, ...]

    def totals(self) -> dict[str, int]:
        """Bytes on this rank by category, over every group."""
        return {c: sum(g.bytes[c] for g in self.groups) for c in CATEGORIES}

    def host_totals(self) -> dict[str, int]:
        """Of ``totals()``, the bytes on the host (host offload), by category."""
        return {c: sum(g.host_bytes[c] for g in self.groups) for c in CATEGORIES}

    def device_totals(self) -> dict[str, int]:
        """Of ``totals()``, the bytes on the device, by category."""
        return {c: sum(g.device_bytes[c] for g in self.groups) for c in CATEGORIES}

    @property
    def between_steps_bytes(self) -> int:
        """What the sharded model (and the optimizer, if given) hold between steps."""
        return sum(g.between_steps_bytes for g in self.groups)

    @property
    def host_between_steps_bytes(self) -> int:
        """Of ``between_steps_bytes``, those on the host."""
        return sum(g.host_bytes[c] for g in self.groups for c in MODEL_STATE_CATEGORIES)

    def __str__(self) -> str:
        header = ["unit", "params", "numel", "strategy", "mesh", "wire (AG/RS)"]
        header += [c.replace("_", " ") for c in CATEGORIES]
        rows = [header]
        for g in self.groups:
            wire = f"{_dtype(g.gather_dtype)}/{_dtype(g.reduce_dtype)}"
            cells = [g.unit or "(root)", str(len(g.params)), f"{g.numel:,}", g.strategy, g.mesh]
            rows.append(cells + [wire] + [_cell(g.bytes[c], g.host_bytes[c]) for c in CATEGORIES])
        totals, host = self.totals(), self.host_totals()
        numel = sum(g.numel for g in self.groups)
        rows.append(
            ["total", "", f"{numel:,}", "", "", ""]
            + [_cell(totals[c], host[c]) for c in CATEGORIES]
        )
        widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
        lines = [
            f"megatron-fsdp on rank {self.rank} of {self.world_size}: "
            f"{format_bytes(self.between_steps_bytes, 2)} held between steps"
        ]
        if self.host_between_steps_bytes:
            lines[0] += f" ({format_bytes(self.host_between_steps_bytes, 2)} of it on the host)"
        for index, row in enumerate(rows):
            padded = (cell.ljust(width) for cell, width in zip(row, widths, strict=True))
            lines.append("  ".join(padded))
            if index == 0 or index == len(rows) - 2:
                lines.append("  ".join("-" * width for width in widths))
        return "\n".join(line.rstrip() for line in lines)


def describe(model: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> ShardingSummary:
    """The ``ShardingSummary`` of every unit in ``model`` (a sharded module, or a root wrapper:
    unit names then start with its ``module.``); ``optimizer`` adds its state's bytes."""
    counted: set[int] = set()  # state storages already counted (a step counter may be shared)
    groups = [
        _summarise(group, path, type(unit.module).__name__, optimizer, counted)
        for path, unit in unit_paths(model)
        for group in unit.groups
    ]
    if not groups:
        raise ValueError(
            f"describe: {type(model).__name__} has no FSDP units; shard it first "
            "(fully_shard, fully_shard_model)"
        )
    rank, world = 0, 1
    if torch.distributed.is_initialized():
        rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    return ShardingSummary(rank, world, tuple(groups))


def heaviest_rank(model: nn.Module) -> int:
    """The global rank whose shards of ``model`` hold the most bytes of the weights the
    optimizer steps (its state is per element of them), the first of them on a tie: ranks
    differ only there. Groups sharded over another group than the first's (experts') rank
    by their own group and do not count. Needs the process group the model was sharded on."""
    groups = [g for _, unit in unit_paths(model) for g in unit.groups if g.model.sharded]
    if not groups:
        return torch.distributed.get_rank()
    shard_group = groups[0].topology.shard_group
    weights = [0] * groups[0].model.layout.world_size
    for group in groups:
        if group.topology.shard_group is shard_group:
            stepped = group.stepped
            for index, numel in enumerate(stepped.layout.data_numel_per_rank()):
                weights[index] += numel * stepped.dtype.itemsize
    largest = max(range(len(weights)), key=lambda i: (weights[i], -i))
    return torch.distributed.get_global_rank(shard_group, largest)


def _summarise(
    group: ParameterGroup,
    unit: str,
    unit_class: str,
    optimizer: torch.optim.Optimizer | None,
    counted: set[int],
) -> GroupSummary:
    layout = group.model.layout
    gathered = layout.padded_numel * group.compute_dtype.itemsize if group.model.sharded else 0
    state, state_on_host = _optimizer_bytes(group, optimizer, counted)
    sizes = {
        "compute_weights": held_bytes(group.model),
        "main_weights": held_bytes(group.main),
        "gradients": group_bytes_per_rank(group)[1],
        "optimizer_state": state,
        "gathered_weights": gathered,
    }
    device = group.topology.device
    host = {
        "compute_weights": sizes["compute_weights"] * _held_on_host(group.model, device),
        "main_weights": sizes["main_weights"] * _held_on_host(group.main, device),
        "gradients": sizes["gradients"] * (group.grads is not None and group.grads.on_host(device)),
        "optimizer_state": state_on_host,
        "gathered_weights": 0,  # gathered where the device computes
    }
    return GroupSummary(
        unit=unit,
        unit_class=unit_class,
        params=tuple(group.names),
        numel=sum(p.numel for p in layout.placements),
        padded_numel=layout.padded_numel,
        requires_grad=group.requires_grad,
        strategy=f"ZeRO-{int(group.strategy)}",
        mesh=_mesh(group),
        gather_dtype=group.compute_dtype,
        reduce_dtype=group.reduce_dtype if group.requires_grad else None,
        bytes=sizes,
        host_bytes=host,
    )


def _held_on_host(buffer: DataParallelBuffer | None, device: torch.device) -> bool:
    return buffer is not None and buffer.has_persistent_shard and on_host(buffer.shard, device)


def _optimizer_bytes(
    group: ParameterGroup, optimizer: torch.optim.Optimizer | None, counted: set[int]
) -> tuple[int, int]:
    """The bytes of the state storages of the group's parameters not ``counted`` yet (the
    contiguous step keeps one step counter for a run of parameters, and its moments are
    views of one buffer per run), and of those the bytes on the host: a state tensor is
    where it is, or (torch's optimizers make their state like the parameter) where the
    parameter it steps is, which tells where the CPU stands in for the device."""
    if optimizer is None:
        return 0, 0
    total = host = 0
    device = group.topology.device
    for param in group.dist_params:
        param_on_host = on_host(local_tensor(param), device)
        for value in optimizer.state.get(param, {}).values():
            if isinstance(value, torch.Tensor):
                local = local_tensor(value)
                storage = local.untyped_storage()
                if id(storage) not in counted:
                    counted.add(id(storage))
                    total += storage.nbytes()
                    on_the_host = param_on_host or on_host(local, device)
                    host += storage.nbytes() if on_the_host else 0
    return total, host


def _cell(nbytes: int, host: int) -> str:
    """A table cell: the bytes, marked ``host`` where they are on the host."""
    if host == 0:
        return format_bytes(nbytes, 2)
    if host == nbytes:
        return f"{format_bytes(nbytes, 2)} host"
    return f"{format_bytes(nbytes - host, 2)} + {format_bytes(host, 2)} host"


def _mesh(group: ParameterGroup) -> str:
    topology = group.topology
    parts = [f"dp_shard={topology.shard_size}"]
    if topology.is_hsdp:
        kind = "optim" if topology.shards_optimizer_across_outer else "replicate"
        parts.append(f"dp_outer={topology.outer_size} ({kind})")
    if topology.tp_mesh is not None:
        parts.append(f"tp={topology.tp_mesh.size()}")
    return " x ".join(parts)


def _dtype(dtype: torch.dtype | None) -> str:
    return "-" if dtype is None else str(dtype).removeprefix("torch.")
