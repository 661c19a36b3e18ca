"""What a user can see of the units: their repr (``describe_unit``), a wrap-time summary
(``log_units``: INFO, first rank of the root's mesh, one line per unit, as NVIDIA
megatron-fsdp's ``_log_parameter_groups``), DEBUG events per unit (``log_event``, as FSDP2's
``TORCH_LOGS=+fsdp``) and the one count and spelling of bytes (``held_bytes``,
``format_bytes``) that ``describe`` and ``megatron_fsdp.plan`` share. A unit is named by its
class until the root is built and knows its path.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Sequence
from typing import Protocol

import torch.distributed as dist

from mfsdp_buffers import DataParallelBuffer
from mfsdp_collectives import group_name
from mfsdp_hooks.config.unit_options import UnitOptions
from mfsdp_hooks.runtime.training_state import TrainingState
from mfsdp_hooks.weights.param_group import ParameterGroup


class FSDPUnit(Protocol):
    """What is shown of a unit (``unit.FSDPUnit``; a Protocol, so ``unit`` imports us)."""

    name: str
    groups: list[ParameterGroup]
    options: UnitOptions
    state: TrainingState


__all__ = [
    "describe_unit",
    "format_bytes",
    "log_event",
    "group_bytes_per_rank",
    "held_bytes",
    "log_units",
    "unit_bytes_per_rank",
    "unit_label",
]

# The logger keeps its documented name wherever this module lives.
_log = logging.getLogger("mfsdp_hooks.observe")
# Each unit's path under its root (recorded by ``log_units``), without keeping units alive.
_PATHS: weakref.WeakKeyDictionary[FSDPUnit, str] = weakref.WeakKeyDictionary()


def held_bytes(buffer: DataParallelBuffer | None) -> int:
    """The bytes of ``buffer`` that persist on this rank between steps (its shard, or all of
    it unsharded; none when it is rebuilt before each use)."""
    if buffer is None or not buffer.has_persistent_shard:
        return 0
    numel = buffer.layout.shard_numel if buffer.sharded else buffer.layout.padded_numel
    return numel * buffer.dtype.itemsize


def group_bytes_per_rank(group: ParameterGroup) -> tuple[int, int]:
    """(weights, gradients): the bytes this rank holds for ``group`` between iterations:
    persistent compute and main weights, the reduced gradient shard (from the first backward).
    The unsharded weights and gradients a running unit needs come on top, for that unit only."""
    weights = held_bytes(group.model) + held_bytes(group.main)
    grads = 0 if group.grads is None else group.grads.numel * group.grads.dtype.itemsize
    return weights, grads


def unit_bytes_per_rank(unit: FSDPUnit) -> int:
    """Weights and gradient bytes this rank holds for ``unit``, over all its groups."""
    return sum(sum(group_bytes_per_rank(group)) for group in unit.groups)


def unit_label(unit: FSDPUnit) -> str:
    """``blocks.0 (Block)`` once the root knows the unit's path, else its class name."""
    path = _PATHS.get(unit)
    if path is None:
        return unit.name
    return f"{path or '<root>'} ({unit.name})"


def log_event(unit: FSDPUnit, event: str) -> None:
    """A DEBUG line per unit event (logger ``mfsdp_hooks.observe``), free when disabled."""
    if _log.isEnabledFor(logging.DEBUG):
        _log.debug("%s: %s", unit_label(unit), event)


def describe_unit(unit: FSDPUnit) -> str:
    """``FSDPUnit.__repr__``: what a user printing a unit wants to know."""
    params = sum(len(group.names) for group in unit.groups)
    return (
        f"FSDPUnit({unit_label(unit)}, params={params}, groups={len(unit.groups)}, "
        f"bytes_per_rank={unit_bytes_per_rank(unit)}, "
        f"strategy={unit.options.strategy.name.lower()}, state={unit.state.name})"
    )


def format_bytes(nbytes: int, digits: int = 1, *, exact: bool = False) -> str:
    """``1.5 MiB``: a size read at a glance, in binary units up to TiB, ``digits`` decimals.

    ``exact`` adds the count to the byte for reports read as figures, thousands grouped:
    ``1.377 GiB (1,478,364,160 B)``. The short form stays ungrouped: one token in a log line
    or a table cell.
    """
    group = "," if exact else ""
    if abs(nbytes) < 1024:
        return f"{nbytes:{group}} B"
    size, unit = nbytes / 1024, "KiB"
    for larger in ("MiB", "GiB", "TiB"):
        if abs(size) < 1024:
            break
        size, unit = size / 1024, larger
    scaled = f"{size:{group}.{digits}f} {unit}"
    return f"{scaled} ({nbytes:,} B)" if exact else scaled


def _dtype(dtype: object) -> str:
    return str(dtype).removeprefix("torch.")


def _describe_group(group: ParameterGroup) -> str:
    topology = group.topology
    dtypes = _dtype(group.original_dtype)
    if group.compute_dtype != group.original_dtype:
        dtypes += f"->{_dtype(group.compute_dtype)} compute"
    if group.main is not None:
        dtypes += f", {_dtype(group.main.dtype)} main"
    frozen = "" if group.requires_grad else " frozen"
    return (
        f"{len(group.names)} params{frozen} {dtypes}, {group.layout.data_numel} elements over "
        f"{group_name(topology.shard_group)}({topology.shard_size})"
    )


def _unit_line(unit: FSDPUnit) -> str:
    weights = sum(group_bytes_per_rank(group)[0] for group in unit.groups)
    grads = sum(group_bytes_per_rank(group)[1] for group in unit.groups)
    groups = "; ".join(_describe_group(group) for group in unit.groups) or "no parameters"
    return (
        f"FSDP unit {unit_label(unit)}: {len(unit.groups)} group(s) [{groups}], "
        f"{unit.options.strategy.name.lower()}, per rank {format_bytes(weights)} weights + "
        f"{format_bytes(grads)} grads"
    )


def _first_of_mesh(units: Sequence[FSDPUnit]) -> bool:
    """Whether this rank is the first of the root's mesh (``units[0]`` is the root: rank 0
    of its shard, outer and TP groups). Not global rank 0: a model sharded over part of the
    world is logged by one of its own ranks, and global rank 0 may hold another model."""
    topology = units[0].options.topology
    tp = topology.tp_group
    tp_rank = 0 if tp is None else dist.get_rank(tp)
    return topology.shard_rank == 0 and topology.outer_rank == 0 and tp_rank == 0


def log_units(root_name: str, units: Sequence[FSDPUnit], paths: Sequence[str]) -> None:
    """Record each unit's path (``unit_label``) and log the model's units at INFO on the
    first rank of the mesh they are sharded over: one line per unit, then the total per rank."""
    for unit, path in zip(units, paths, strict=True):
        _PATHS[unit] = path.removesuffix(".")
    if not _log.isEnabledFor(logging.INFO) or not _first_of_mesh(units):
        return
    for unit in units:
        _log.info("%s", _unit_line(unit))
    total = sum(unit_bytes_per_rank(unit) for unit in units)
    _log.info("FSDP model %s: %d unit(s), %s per rank", root_name, len(units), format_bytes(total))
