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

The model may be on the meta device (``torch.device("meta")``: a 70B model costs nothing to
plan). Transient memory (gathered weights, gradient buffers in flight, activations) and the
peak are not planned here: ``describe()`` after wrapping gives the gathered-weights bytes of
each unit.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from mfsdp_buffers import BucketKey, FlatLayout, build_buckets
from mfsdp_hooks import (
    DEFAULT_ALIGNMENT,
    MixedPrecisionPolicy,
    UnitSpec,
    parse_strategy,
    resolve_unit_modules,
)

__all__ = ["MODEL_STATE_CATEGORIES", "ModelStatesPlan", "plan_model_states"]

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
    units: tuple[tuple[str, int], ...]
    """(unit name, elements it owns), in the order the units are built."""

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
class _Group:
    shapes: tuple[torch.Size, ...]
    dtype: torch.dtype
    requires_grad: bool


def plan_model_states(
    module: nn.Module,
    *,
    world_size: int,
    fsdp_unit_modules: Sequence[UnitSpec] | None = None,
    zero_dp_strategy: int | str = 3,
    mixed_precision_policy: MixedPrecisionPolicy | None = None,
    optimizer: str | StateBytes = "adamw",
) -> ModelStatesPlan:
    """Plan ``module`` sharded by ``fully_shard_model(module, fsdp_unit_modules,
    zero_dp_strategy=..., mixed_precision_policy=...)`` over ``world_size`` ranks, stepped by
    ``optimizer`` ("adam", "adamw", "sgd" without momentum, or a ``StateBytes`` function).
    Nothing is communicated or allocated; ``module`` may live on the meta device."""
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive int, got {world_size!r}")
    strategy = int(parse_strategy(zero_dp_strategy, "zero_dp_strategy"))
    if isinstance(optimizer, str):
        if optimizer.lower() not in _OPTIMIZERS:
            raise ValueError(
                f"optimizer={optimizer!r}: use one of {sorted(_OPTIMIZERS)} or a function "
                "(elements this rank steps, dtype) -> state bytes"
            )
        optimizer = _OPTIMIZERS[optimizer.lower()]
    policy = mixed_precision_policy or MixedPrecisionPolicy()
    units = _units(module, fsdp_unit_modules)
    per_rank = [dict.fromkeys(MODEL_STATE_CATEGORIES, 0) for _ in range(world_size)]
    for _, groups in units:
        for group in groups:
            _add_group(per_rank, group, strategy, policy, optimizer)
    largest = max(range(world_size), key=lambda r: sum(per_rank[r].values()))
    unit_sizes = tuple(
        (name, sum(s.numel() for g in groups for s in g.shapes)) for name, groups in units
    )
    return ModelStatesPlan(
        world_size, strategy, largest, per_rank[largest], tuple(per_rank), unit_sizes
    )


def _add_group(
    per_rank: list[dict[str, int]],
    group: _Group,
    strategy: int,
    policy: MixedPrecisionPolicy,
    state_bytes: StateBytes,
) -> None:
    world = len(per_rank)
    layout = FlatLayout.build(group.shapes, world_size=world, alignment=DEFAULT_ALIGNMENT)
    compute = policy.compute_dtype(group.dtype)
    optim = policy.optimizer_dtype(group.dtype)
    whole_or_shard = layout.shard_numel if strategy >= 1 else layout.padded_numel
    if strategy == 3:
        compute_numel = layout.shard_numel if optim == compute else 0  # else rebuilt per gather
    else:
        compute_numel = layout.padded_numel
    main_numel = whole_or_shard if optim != compute else 0
    grads = whole_or_shard * policy.grad_dtype(group.dtype).itemsize if group.requires_grad else 0
    for rank, sizes in enumerate(per_rank):
        sizes["compute_weights"] += compute_numel * compute.itemsize
        sizes["main_weights"] += main_numel * optim.itemsize
        sizes["gradients"] += grads
        if group.requires_grad:
            for index, shape in enumerate(group.shapes):
                stepped = shape.numel() if strategy == 0 else layout.local_piece(index, rank).numel
                sizes["optimizer_state"] += state_bytes(stepped, optim)


def _units(
    module: nn.Module, fsdp_unit_modules: Sequence[UnitSpec] | None
) -> list[tuple[str, list[_Group]]]:
    """Each unit, in the order ``fully_shard_model`` builds them (inner blocks last to first,
    then the root), and its parameter groups: the parameters it owns (not those of units
    built before it), by dtype and ``requires_grad`` in order of first appearance, tied
    parameters once."""
    classes = resolve_unit_modules(fsdp_unit_modules)
    targets = [(n, m) for n, m in module.named_modules() if classes and isinstance(m, classes)]
    order = [(n, m) for n, m in reversed(targets) if m is not module] + [("", module)]
    is_unit = {id(m) for _, m in order}
    seen: set[int] = set()
    units: list[tuple[str, list[_Group]]] = []
    for name, unit in order:
        owned: list[nn.Parameter] = []
        _collect(unit, is_unit, seen, owned, top=True)
        keys = [
            (i, BucketKey(name, p.dtype, "", p.requires_grad), p.numel())
            for i, p in enumerate(owned)
        ]
        groups = [
            _Group(
                tuple(owned[i].shape for i in bucket.param_indices),
                bucket.key.dtype,
                bucket.key.requires_grad,
            )
            for bucket in build_buckets(keys)
        ]
        units.append((name, groups))
    return units


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
