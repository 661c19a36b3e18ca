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
    MODEL_STATE_CATEGORIES,
    MixedPrecisionPolicy,
    ParamClassCodec,
    UnitSpec,
    format_bytes,
    is_megatron_expert,
    local_tensor,
    parse_strategy,
    resolve_unit_modules,
)
from mfsdp_te import float8_codecs

__all__ = [
    "MODEL_STATE_CATEGORIES",
    "ModelStatesPlan",
    "PlannedGroup",
    "PlannedUnit",
    "Topology",
    "plan_model_states",
    "owned_parameters",
    "plan_bytes",
    "planned_units",
    "state_bytes_of",
    "topology_of",
]

ExpertPredicate = Callable[[str, nn.Parameter], bool]
"""``(parameter name within its unit, parameter) -> is it an expert's``."""

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
            lines.append(f"  {name:<16} {plan_bytes(self.categories[name])}")
        lines.append(f"  {'total':<16} {plan_bytes(self.between_steps_bytes)}")
        return "\n".join(lines)


@dataclass(frozen=True)
class Topology:
    """The data-parallel layout being planned: ``outer`` replicas of ``shard`` ranks, each
    of them ``tp`` tensor-parallel ranks; expert parameters sharded over the ``shard / ep``
    ranks that hold the same experts."""

    shard: int
    outer: int = 1
    hfsdp: bool = False
    """Main weights, gradients and optimizer state cut across the replicas too."""
    tp: int = 1
    ep: int = 1

    @property
    def dp_world(self) -> int:
        """Data-parallel ranks (each stands for its ``tp`` tensor-parallel ranks)."""
        return self.shard * self.outer

    def shard_size(self, expert: bool) -> int:
        return self.shard // self.ep if expert else self.shard

    def optim_size(self, expert: bool = False) -> int:
        return self.dp_world if self.hfsdp else self.shard_size(expert)

    def optim_index(self, rank: int, expert: bool = False) -> int:
        """The optimizer-facing shard data-parallel rank ``rank`` holds (HFSDP: its
        replica's sub-shard of its compute shard, ``shard_rank * outer + outer_rank``;
        experts: its index in the expert-data-parallel group, ranks ``(edp, ep)``-major)."""
        shard_rank, outer_rank = rank % self.shard, rank // self.shard
        if expert:
            return shard_rank // self.ep
        return shard_rank * self.outer + outer_rank if self.hfsdp else shard_rank


@dataclass(frozen=True)
class PlannedGroup:
    """One parameter group of a unit as the engine packs it."""

    shapes: tuple[torch.Size, ...]
    dtype: torch.dtype
    requires_grad: bool
    expert: bool = False
    wire_dtype: torch.dtype | None = None
    """A codec's (float8 weights): what the compute buffer holds and the all-gather moves."""

    def compute_dtype(self, policy: MixedPrecisionPolicy) -> torch.dtype:
        return self.wire_dtype or policy.compute_dtype(self.dtype)

    def optim_layout(self, topology: Topology) -> FlatLayout:
        size = topology.optim_size(self.expert)
        return FlatLayout.build(self.shapes, world_size=size, alignment=DEFAULT_ALIGNMENT)

    def layout(self, topology: Topology) -> FlatLayout:
        """The compute cut (what the shard group all-gathers)."""
        merge = topology.optim_size(self.expert) // topology.shard_size(self.expert)
        return self.optim_layout(topology).merged(merge)


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


def topology_of(
    world_size: int, outer_dp_size: int, outer_strategy: str, tp_size: int = 1, ep_size: int = 1
) -> Topology:
    sizes = {
        "world_size": world_size,
        "outer_dp_size": outer_dp_size,
        "tp_size": tp_size,
        "ep_size": ep_size,
    }
    for name, value in sizes.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    if world_size % (outer_dp_size * tp_size):
        raise ValueError(
            f"outer_dp_size={outer_dp_size} x tp_size={tp_size} must divide "
            f"world_size={world_size} (the ranks are outer_dp_size replicas of a shard group "
            "of tp_size tensor-parallel ranks each)"
        )
    shard = world_size // (outer_dp_size * tp_size)
    if shard % ep_size:
        raise ValueError(
            f"ep_size={ep_size} must divide the data-parallel shard group's {shard} ranks"
        )
    hfsdp = outer_strategy == "optim" and outer_dp_size > 1
    if ep_size > 1 and outer_dp_size > 1:
        raise NotImplementedError(
            "planning expert parallelism together with HSDP (outer_dp_size > 1) is not "
            "supported yet: plan with outer_dp_size=1"
        )
    return Topology(shard, outer_dp_size, hfsdp, tp_size, ep_size)


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
    tp_size: int = 1,
    ep_size: int = 1,
    is_expert: ExpertPredicate = is_megatron_expert,
    param_codecs: Sequence[ParamClassCodec] | None = None,
) -> ModelStatesPlan:
    """Plan ``module`` sharded by ``fully_shard_model(module, fsdp_unit_modules,
    zero_dp_strategy=..., mixed_precision_policy=..., outer_dp_sharding_strategy=...)`` over
    ``world_size`` ranks (``outer_dp_size`` replicas of a shard group), stepped by
    ``optimizer`` ("adam", "adamw", "sgd" without momentum, or a ``StateBytes`` function).
    Nothing is communicated or allocated; ``module`` may live on the meta device.

    Tensor and expert parallelism: ``module`` is then the model one rank holds, as
    Megatron-Core builds it (tensor-parallel layers at their local shapes, the local
    experts only); ``tp_size`` of its ranks make one data-parallel rank (the shard group
    has ``world_size / (outer_dp_size * tp_size)``), and the parameters ``is_expert`` names
    (Megatron-Core's ``allreduce=False`` by default) are sharded over the
    ``shard / ep_size`` ranks that hold the same experts, as ``expt_device_mesh`` does.
    ``per_rank`` then lists the data-parallel ranks. ``param_codecs``: the codecs
    ``fully_shard_model`` claims tensor-subclass weights with (default: the float8 ones,
    as it does), whose groups hold and gather their ``wire_dtype``."""
    strategy = int(parse_strategy(zero_dp_strategy, "zero_dp_strategy"))
    outer = parse_outer_strategy(outer_dp_sharding_strategy, strategy)
    topology = topology_of(world_size, outer_dp_size, outer, tp_size, ep_size)
    state_bytes = state_bytes_of(optimizer)
    policy = mixed_precision_policy or MixedPrecisionPolicy()
    codecs = float8_codecs() if param_codecs is None else tuple(param_codecs)
    experts = is_expert if ep_size > 1 else None
    units = planned_units(module, fsdp_unit_modules, experts, codecs)
    per_rank = [dict.fromkeys(MODEL_STATE_CATEGORIES, 0) for _ in range(topology.dp_world)]
    for unit in units:
        for group in unit.groups:
            _add_group(per_rank, group, topology, strategy, policy, state_bytes)
    largest = max(range(topology.dp_world), key=lambda r: sum(per_rank[r].values()))
    return ModelStatesPlan(
        world_size, strategy, largest, per_rank[largest], tuple(per_rank), tuple(units)
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
    compute = group.compute_dtype(policy)
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
    state = _state_by_shard(group, optim_layout, strategy, state_bytes, optim)
    for rank, sizes in enumerate(per_rank):
        sizes["compute_weights"] += compute_numel * compute.itemsize
        sizes["main_weights"] += main_numel * optim.itemsize
        sizes["gradients"] += grads
        sizes["optimizer_state"] += state[topology.optim_index(rank, group.expert)]


def _state_by_shard(
    group: PlannedGroup,
    layout: FlatLayout,
    strategy: int,
    state_bytes: StateBytes,
    dtype: torch.dtype,
) -> list[int]:
    """The optimizer-state bytes of each optimizer-facing shard: per parameter, the state of
    the rows of it in the shard (every parameter has state, empty rows included). Only the
    shards a parameter overlaps are visited, so a world of thousands costs little."""
    shards = layout.world_size
    if not group.requires_grad:
        return [0] * shards
    if strategy == 0:  # each rank steps the whole of every parameter
        return [sum(state_bytes(shape.numel(), dtype) for shape in group.shapes)] * shards
    empty = state_bytes(0, dtype)
    state = [empty * len(group.shapes)] * shards
    size = layout.shard_numel
    for placement in layout.placements:
        if placement.numel == 0 or size == 0:
            continue
        first, last = placement.offset // size, (placement.end - 1) // size
        for shard in range(first, min(last, shards - 1) + 1):
            start, end = shard * size, (shard + 1) * size
            rows = min(end, placement.end) - max(start, placement.offset)
            state[shard] += state_bytes(rows, dtype) - empty
    return state


def planned_units(
    module: nn.Module,
    fsdp_unit_modules: Sequence[UnitSpec] | None,
    is_expert: ExpertPredicate | None = None,
    codecs: Sequence[ParamClassCodec] = (),
) -> list[PlannedUnit]:
    """Each unit, in the order ``fully_shard_model`` builds them (inner blocks last to first,
    then the root), and its parameter groups: the parameters it owns (not those of units
    built before it), by dtype, ``requires_grad``, (with ``is_expert``) dense or expert and
    the codec that claims them, in order of first appearance, tied parameters once."""
    units: list[PlannedUnit] = []
    for name, owned in owned_parameters(module, fsdp_unit_modules):
        names = _names_in(module, name)
        experts = [is_expert is not None and is_expert(names[id(p)], p) for p in owned]
        local = [local_tensor(p) for p in owned]  # a DTensor's: this TP rank's
        claimed = [next((c for c in codecs if c.claims(p)), None) for p in owned]
        kinds = [
            ("expert" if experts[i] else "") + (f"+{codec.name}" if codec else "")
            for i, codec in enumerate(claimed)
        ]
        wire = {kind: c.wire_dtype for kind, c in zip(kinds, claimed, strict=True) if c}
        keys = [
            (i, BucketKey(name, p.dtype, kinds[i], p.requires_grad), local[i].numel())
            for i, p in enumerate(owned)
        ]
        groups = tuple(
            PlannedGroup(
                tuple(local[i].shape for i in bucket.param_indices),
                bucket.key.dtype,
                bucket.key.requires_grad,
                expert=bucket.key.group.startswith("expert"),
                wire_dtype=wire.get(bucket.key.group),
            )
            for bucket in build_buckets(keys)
        )
        units.append(PlannedUnit(name, groups))
    return units


def _names_in(module: nn.Module, unit: str) -> dict[int, str]:
    """Each parameter's name within the unit ``unit`` (the name ``is_expert`` is given)."""
    root = module.get_submodule(unit) if unit else module
    return {id(p): n for n, p in root.named_parameters(remove_duplicate=False)}


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


def plan_bytes(nbytes: int) -> str:
    """``1.377 GiB (1,478,364,160 B)``: a planned size read at a glance, and exactly."""
    return format_bytes(nbytes, 3, exact=True)
