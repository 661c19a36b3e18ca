"""``plan_model_states``: the bytes a model's states take per rank, at any world size, before
a run, with no process group and no parameter memory.

What DeepSpeed's ``estimate_zero3_model_states_mem_needs_*`` answers (weights, gradients and
optimizer state between steps), but exactly: the model's parameters are packed into the same
flat layouts ``fully_shard_model`` builds (same units, same parameter groups, same
alignment and padding; ``mfsdp_buffers.FlatLayout``), and each category is what the engine
keeps for the strategy and the mixed-precision policy (``mfsdp_hooks.describe`` names them):

* ``compute_weights``: the whole padded buffer under ZeRO-0/1/2; one shard under ZeRO-3,
  none when ZeRO-3 rebuilds the compute weights from main weights of another dtype.
* ``main_weights``: when the optimizer's dtype differs from the compute dtype, the
  optimizer's shard (the whole buffer under ZeRO-0).
* ``gradients``: the reduced gradient kept for the optimizer (its shard under ZeRO-1/2/3).
* ``optimizer_state``: per parameter, the rows of it this rank steps, times the optimizer's
  state per element (Adam/AdamW: two moments and a 4-byte ``step``), so it differs from
  rank to rank; the plan reports the largest rank.

Hybrid sharding: with ``outer_dp_size=O`` the ``W`` ranks are ``O`` replicas of a shard
group of ``W/O`` (HSDP, rank ``r`` is shard rank ``r % (W/O)`` of replica ``r // (W/O)``);
``outer_dp_sharding_strategy="optim"`` (HFSDP) cuts main weights, gradients and optimizer
state across the replicas too.

The model may be on the meta device (``torch.device("meta")``: a 70B model costs nothing to
plan). Transient memory (gathered weights, gradients in flight, activations) and the peak
are ``plan_memory``'s (``memory.py``), which starts from this plan.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from megatron_fsdp.hybrid import parse_outer_strategy
from mfsdp_buffers import BucketKey, FlatLayout, build_buckets
from mfsdp_hooks import (
    DEFAULT_ALIGNMENT,
    MixedPrecisionPolicy,
    UnitSpec,
    parse_strategy,
    resolve_unit_modules,
)

__all__ = [
    "MODEL_STATE_CATEGORIES",
    "ModelStatesPlan",
    "PlannedGroup",
    "PlannedUnit",
    "Topology",
    "plan_model_states",
    "owned_parameters",
    "planned_units",
    "state_bytes_of",
    "topology_of",
]

MODEL_STATE_CATEGORIES = ("compute_weights", "main_weights", "gradients", "optimizer_state")

StateBytes = Callable[[int, torch.dtype], int]
"""``(elements of a parameter this rank steps, optimizer dtype) -> bytes of its state``."""

_OPTIMIZERS: dict[str, StateBytes] = {
    "sgd": lambda numel, dtype: 0,
    "adam": lambda numel, dtype: 2 * numel * dtype.itemsize + 4,
    "adamw": lambda numel, dtype: 2 * numel * dtype.itemsize + 4,
}


@dataclass(frozen=True)
class ModelStatesPlan:
    """Per-rank bytes of the model's states; ``str()`` is a table."""

    world_size: int
    strategy: int
    largest_rank: int
    categories: dict[str, int]
    """Bytes by category on ``largest_rank``."""
    per_rank: tuple[dict[str, int], ...]
    """Bytes by category on every rank, in rank order."""
    units: tuple[PlannedUnit, ...]
    """The units, in the order ``fully_shard_model`` builds them."""

    @property
    def between_steps_bytes(self) -> int:
        """What the largest rank holds between steps: the sum of the categories."""
        return sum(self.categories.values())

    def __str__(self) -> str:
        lines = [
            f"model states per rank at world size {self.world_size}, ZeRO-{self.strategy} "
            f"(largest: rank {self.largest_rank})"
        ]
        for name in MODEL_STATE_CATEGORIES:
            lines.append(f"  {name:<16} {_gib(self.categories[name])}")
        lines.append(f"  {'total':<16} {_gib(self.between_steps_bytes)}")
        return "\n".join(lines)


@dataclass(frozen=True)
class Topology:
    """The data-parallel layout being planned: ``outer`` replicas of ``shard`` ranks."""

    shard: int
    outer: int = 1
    hfsdp: bool = False
    """Main weights, gradients and optimizer state cut across the replicas too."""

    @property
    def world(self) -> int:
        return self.shard * self.outer

    @property
    def optim_size(self) -> int:
        return self.world if self.hfsdp else self.shard

    def optim_index(self, rank: int) -> int:
        """The optimizer-facing shard global rank ``rank`` holds (HFSDP: its replica's
        sub-shard of its compute shard, ``shard_rank * outer + outer_rank``)."""
        shard_rank, outer_rank = rank % self.shard, rank // self.shard
        return shard_rank * self.outer + outer_rank if self.hfsdp else shard_rank


@dataclass(frozen=True)
class PlannedGroup:
    """One parameter group of a unit as the engine packs it."""

    shapes: tuple[torch.Size, ...]
    dtype: torch.dtype
    requires_grad: bool

    def optim_layout(self, topology: Topology) -> FlatLayout:
        return FlatLayout.build(
            self.shapes, world_size=topology.optim_size, alignment=DEFAULT_ALIGNMENT
        )

    def layout(self, topology: Topology) -> FlatLayout:
        """The compute cut (what the shard group all-gathers)."""
        return self.optim_layout(topology).merged(topology.optim_size // topology.shard)


@dataclass(frozen=True)
class PlannedUnit:
    """A unit: its name (the module's path, ``""`` for the root) and its groups."""

    name: str
    groups: tuple[PlannedGroup, ...]

    @property
    def numel(self) -> int:
        return sum(s.numel() for g in self.groups for s in g.shapes)


def state_bytes_of(optimizer: str | StateBytes) -> StateBytes:
    """``optimizer`` ("adam", "adamw", "sgd", or a function) as a ``StateBytes`` function."""
    if not isinstance(optimizer, str):
        return optimizer
    if optimizer.lower() not in _OPTIMIZERS:
        raise ValueError(
            f"optimizer={optimizer!r}: use one of {sorted(_OPTIMIZERS)} or a function "
            "(elements this rank steps, dtype) -> state bytes"
        )
    return _OPTIMIZERS[optimizer.lower()]


def topology_of(world_size: int, outer_dp_size: int, outer_strategy: str) -> Topology:
    for name, value in (("world_size", world_size), ("outer_dp_size", outer_dp_size)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    if world_size % outer_dp_size:
        raise ValueError(
            f"outer_dp_size={outer_dp_size} must divide world_size={world_size} (the ranks "
            "are outer_dp_size replicas of a shard group)"
        )
    hfsdp = outer_strategy == "optim" and outer_dp_size > 1
    return Topology(world_size // outer_dp_size, outer_dp_size, hfsdp)


def plan_model_states(
    module: nn.Module,
    *,
    world_size: int,
    fsdp_unit_modules: Sequence[UnitSpec] | None = None,
    zero_dp_strategy: int | str = 3,
    mixed_precision_policy: MixedPrecisionPolicy | None = None,
    optimizer: str | StateBytes = "adamw",
    outer_dp_size: int = 1,
    outer_dp_sharding_strategy: int | str = 0,
) -> ModelStatesPlan:
    """Plan ``module`` sharded by ``fully_shard_model(module, fsdp_unit_modules,
    zero_dp_strategy=..., mixed_precision_policy=..., outer_dp_sharding_strategy=...)`` over
    ``world_size`` ranks (``outer_dp_size`` replicas of ``world_size / outer_dp_size``),
    stepped by ``optimizer`` ("adam", "adamw", "sgd" without momentum, or a ``StateBytes``
    function). Nothing is communicated or allocated; ``module`` may live on the meta device."""
    strategy = int(parse_strategy(zero_dp_strategy, "zero_dp_strategy"))
    outer = parse_outer_strategy(outer_dp_sharding_strategy, strategy)
    topology = topology_of(world_size, outer_dp_size, outer)
    state_bytes = state_bytes_of(optimizer)
    policy = mixed_precision_policy or MixedPrecisionPolicy()
    units = planned_units(module, fsdp_unit_modules)
    per_rank = [dict.fromkeys(MODEL_STATE_CATEGORIES, 0) for _ in range(topology.world)]
    for unit in units:
        for group in unit.groups:
            _add_group(per_rank, group, topology, strategy, policy, state_bytes)
    largest = max(range(topology.world), key=lambda r: sum(per_rank[r].values()))
    return ModelStatesPlan(
        topology.world, strategy, largest, per_rank[largest], tuple(per_rank), tuple(units)
    )


def _add_group(
    per_rank: list[dict[str, int]],
    group: PlannedGroup,
    topology: Topology,
    strategy: int,
    policy: MixedPrecisionPolicy,
    state_bytes: StateBytes,
) -> None:
    optim_layout = group.optim_layout(topology)
    layout = group.layout(topology)
    compute = policy.compute_dtype(group.dtype)
    optim = policy.optimizer_dtype(group.dtype)
    whole_or_shard = optim_layout.shard_numel if strategy >= 1 else optim_layout.padded_numel
    if strategy == 3:
        # Rebuilt per gather from main weights of another dtype, except under HFSDP (a
        # rebuild would cost an all-gather across the replicas).
        kept = optim == compute or topology.hfsdp
        compute_numel = layout.shard_numel if kept else 0
    else:
        compute_numel = layout.padded_numel
    main_numel = whole_or_shard if optim != compute else 0
    grads = whole_or_shard * policy.grad_dtype(group.dtype).itemsize if group.requires_grad else 0
    for rank, sizes in enumerate(per_rank):
        sizes["compute_weights"] += compute_numel * compute.itemsize
        sizes["main_weights"] += main_numel * optim.itemsize
        sizes["gradients"] += grads
        if group.requires_grad:
            index_of_rank = topology.optim_index(rank)
            for index, shape in enumerate(group.shapes):
                stepped = (
                    shape.numel()
                    if strategy == 0
                    else optim_layout.local_piece(index, index_of_rank).numel
                )
                sizes["optimizer_state"] += state_bytes(stepped, optim)


def planned_units(
    module: nn.Module, fsdp_unit_modules: Sequence[UnitSpec] | None
) -> list[PlannedUnit]:
    """Each unit, in the order ``fully_shard_model`` builds them (inner blocks last to first,
    then the root), and its parameter groups: the parameters it owns (not those of units
    built before it), by dtype and ``requires_grad`` in order of first appearance, tied
    parameters once."""
    units: list[PlannedUnit] = []
    for name, owned in owned_parameters(module, fsdp_unit_modules):
        keys = [
            (i, BucketKey(name, p.dtype, "", p.requires_grad), p.numel())
            for i, p in enumerate(owned)
        ]
        groups = tuple(
            PlannedGroup(
                tuple(owned[i].shape for i in bucket.param_indices),
                bucket.key.dtype,
                bucket.key.requires_grad,
            )
            for bucket in build_buckets(keys)
        )
        units.append(PlannedUnit(name, groups))
    return units


def owned_parameters(
    module: nn.Module, fsdp_unit_modules: Sequence[UnitSpec] | None
) -> list[tuple[str, list[nn.Parameter]]]:
    """(unit name, the parameters it owns) in the order the units are built."""
    classes = resolve_unit_modules(fsdp_unit_modules)
    targets = [(n, m) for n, m in module.named_modules() if classes and isinstance(m, classes)]
    order = [(n, m) for n, m in reversed(targets) if m is not module] + [("", module)]
    is_unit = {id(m) for _, m in order}
    seen: set[int] = set()
    owners: list[tuple[str, list[nn.Parameter]]] = []
    for name, unit in order:
        owned: list[nn.Parameter] = []
        _collect(unit, is_unit, seen, owned, top=True)
        owners.append((name, owned))
    return owners


def _collect(
    module: nn.Module, is_unit: set[int], seen: set[int], out: list[nn.Parameter], top: bool
) -> None:
    if not top and id(module) in is_unit:
        return
    for param in module.parameters(recurse=False):
        if id(param) not in seen:
            seen.add(id(param))
            out.append(param)
    for child in module.children():
        _collect(child, is_unit, seen, out, top=False)


def _gib(nbytes: int) -> str:
    return f"{nbytes / 2**30:,.3f} GiB ({nbytes:,} B)"
