"""``plan_memory``: a rank's peak bytes through a training step, and where it occurs, before
a run: the engine itself, run for one rank on fake tensors (``fake_run``). The categories of
a segment's peak:

* ``compute_weights``, ``main_weights``, ``optimizer_state``: what the engine's buffers and
  the optimizer hold from step to step (``describe`` of the rank), and ``other_states`` for
  the rest of what persists (the model's buffers, the engine's small state);
* ``engine_buffers``: what the engine's own code allocated during the step and still holds
  then: gathered weights, the gradients' reduce buffers and shards, codec temporaries;
* ``activations``: what the model's code and autograd allocated during the step: the
  activations, autograd's gradients before the engine takes them, the optimizer's
  temporaries.

With host offload (``optimizer_cpu_offload=True``) the peak and its categories are the
device's, and the host's bytes are planned apart (``host_peak_bytes``, ``host_states``).

Ranks differ only in how many parameter elements their shards hold; the plan runs the rank
holding the most, found on the engine's layouts after a first run of rank 0.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

from megatron_fsdp.plan.fake_run import (
    ENGINE,
    MODEL,
    ModelSource,
    OptimizerSpec,
    RankRun,
    optimizer_factory,
    run_rank,
    run_route,
)
from mfsdp_buffers import PhaseMark
from mfsdp_hooks import MODEL_STATE_CATEGORIES, ShardingSummary, format_bytes

__all__ = ["MEMORY_CATEGORIES", "MemoryPlan", "PhaseBytes", "plan_memory"]

_STATES = tuple(name for name in MODEL_STATE_CATEGORIES if name != "gradients")
MEMORY_CATEGORIES = (*_STATES, "other_states", "engine_buffers", "activations")
"""What persists from step to step, then what lives only within a step (module docstring)."""

# Built by plan_memory on the fake world: a user's mesh or groups belong to another world.
_BUILT_HERE = ("device_mesh", "hybrid_fsdp_group", "expt_device_mesh")


@dataclass(frozen=True)
class PhaseBytes:
    """The peak of one segment of the step (``forward of blocks.0 (Block)``,
    ``backward of ...``, ``optimizer step``), by category."""

    phase: str
    categories: dict[str, int]

    @property
    def total(self) -> int:
        return sum(self.categories.values())


@dataclass(frozen=True)
class MemoryPlan:
    """One rank's peak through a training step; ``str()`` is a table."""

    world_size: int
    rank: int
    states: ShardingSummary
    """What the rank holds between steps, unit by unit (``describe``)."""
    phases: tuple[PhaseBytes, ...]
    between_steps_bytes: int
    """Every live byte on the device after ``optimizer.step()``: weights, gradients,
    optimizer state."""
    host_peak_bytes: int = 0
    """The host's peak through the step (host offload: what moved there, and the optimizer
    step's temporaries on the host); 0 without offload."""
    host_between_steps_bytes: int = 0
    """Every live byte on the host after ``optimizer.step()``."""

    @property
    def host_states(self) -> dict[str, int]:
        """What lives on the host between steps, by category (``describe``'s)."""
        return {name: nbytes for name, nbytes in self.states.host_totals().items() if nbytes}

    @property
    def _peak(self) -> PhaseBytes:
        return max(self.phases, key=lambda p: p.total)

    @property
    def peak_bytes(self) -> int:
        """The highest live bytes of the rank through the step."""
        return self._peak.total

    @property
    def peak_phase(self) -> str:
        return self._peak.phase

    @property
    def categories(self) -> dict[str, int]:
        """Bytes by category at the peak."""
        return dict(self._peak.categories)

    def __str__(self) -> str:
        lines = [
            f"memory of rank {self.rank} of {self.world_size}",
            f"  peak {format_bytes(self.peak_bytes, 2)} in {self.peak_phase}:",
        ]
        for name, nbytes in self.categories.items():
            lines.append(f"    {name:<18} {format_bytes(nbytes, 2)}")
        lines.append(f"  between steps {format_bytes(self.between_steps_bytes, 2)}")
        if self.host_peak_bytes:
            lines.append(f"  on the host: peak {format_bytes(self.host_peak_bytes, 2)}, of it")
            for name, nbytes in self.host_states.items():
                lines.append(f"    {name:<18} {format_bytes(nbytes, 2)}")
        return "\n".join(lines)


def plan_memory(
    module: ModelSource,
    *,
    world_size: int,
    example_inputs: Sequence[Any] | None = None,
    example_kwargs: dict[str, Any] | None = None,
    loss_fn: Callable[[Any], torch.Tensor] | None = None,
    optimizer: OptimizerSpec = "adamw",
    outer_dp_size: int = 1,
    device: torch.device | str = "cuda",
    rank: int | None = None,
    after_wrap: Callable[[nn.Module], object] | None = None,
    **fully_shard_model_arguments: Any,
) -> MemoryPlan:
    """Plan the peak of ``module`` trained with ``fully_shard_model(module, ...)`` on one
    rank of ``world_size``: the largest (module docstring), or ``rank``.

    ``module``: a model, best on the meta device, or a function the fake world runs to build
    it as the training script does: it returns the model, or the model and the
    ``fully_shard_model`` arguments that go with it (``device_mesh=`` and ``tp_dim=`` of
    the mesh it parallelised the model over, ``expt_device_mesh=``...; build meshes on
    ``"cpu"``). ``example_inputs``/``example_kwargs``: one rank's batch (meta or real
    tensors; integer meta tensors become zeros); ``loss_fn(output)`` gives the loss (default:
    the output's ``loss``, else the sum of its floating-point tensors). ``optimizer``:
    ``"adamw"``, ``"adam"``, ``"sgd"`` or a function of the parameters.
    ``outer_dp_size``: HSDP, ``outer_dp_size`` replicas of ``world_size / outer_dp_size``
    ranks (with ``outer_dp_sharding_strategy="optim"``: HFSDP). ``device``: where the ranks
    train (``"cuda"`` or ``"cpu"``; see ``fake_run.run_route``). ``after_wrap(model)``: what
    the training script does to the sharded model before building its optimizer
    (``quantize_communication``...). Every other keyword goes to ``fully_shard_model``.
    """
    _check(world_size, rank, outer_dp_size, fully_shard_model_arguments)
    build_optimizer = optimizer_factory(optimizer)
    if example_inputs is None and example_kwargs is None:
        raise ValueError(
            "plan_memory runs one real training step: pass example_inputs (and/or "
            "example_kwargs), one rank's batch; meta tensors are fine"
        )
    arguments = dict(fully_shard_model_arguments)
    transport = arguments.pop("host_transport", "auto")
    # The weights are fake: there are no values to compare across ranks, only ops to dispatch.
    arguments["check_replicas"] = False
    run = functools.partial(
        run_rank,
        module,
        world_size=world_size,
        meshes=_hsdp(outer_dp_size, world_size) if outer_dp_size > 1 else None,
        optimizer=build_optimizer,
        inputs=(tuple(example_inputs or ()), dict(example_kwargs or {})),
        loss_fn=loss_fn,
        route=run_route(torch.device(device), transport),
        wrap_arguments=arguments,
        after_wrap=after_wrap,
    )
    planned = run(rank=0 if rank is None else rank)
    if rank is None and planned.largest_rank != planned.rank:
        planned = run(rank=planned.largest_rank)
    return _plan(planned, world_size)


def _hsdp(outer: int, world_size: int) -> Callable[[str], dict[str, Any]]:
    """HSDP's wrap arguments, made in the fake world: ``outer`` replicas of shard groups."""

    def meshes(device_type: str) -> dict[str, Any]:
        shape, names = (outer, world_size // outer), ("dp_outer", "dp_shard")
        mesh = init_device_mesh(device_type, shape, mesh_dim_names=names)
        return dict(
            device_mesh=mesh,
            dp_outer_dim=names[0],
            dp_shard_dim=names[1],
            hybrid_fsdp_group=dist.group.WORLD,
        )

    return meshes


def _plan(run: RankRun, world_size: int) -> MemoryPlan:
    totals = run.states.device_totals()
    states = {name: totals[name] for name in _STATES}
    states["other_states"] = run.start.live - sum(states.values())
    phases = tuple(
        PhaseBytes(mark.name, {**states, **_transient(mark, run.start)}) for mark in run.segments
    )
    host_peak = max([run.start.host_live, *(mark.host_peak for mark in run.segments)])
    return MemoryPlan(
        world_size, run.rank, run.states, phases, run.between_steps, host_peak, run.host_between
    )


def _transient(mark: PhaseMark, start: PhaseMark) -> dict[str, int]:
    """What the step allocated and still held at the segment's peak, by who allocated it."""
    at_peak, before = mark.peak_by_site or {}, start.peak_by_site or {}
    engine = at_peak.get(ENGINE, 0) - before.get(ENGINE, 0)
    model = at_peak.get(MODEL, 0) - before.get(MODEL, 0)
    unnamed = mark.peak - start.live - engine - model  # storages of no site: none expected
    return {"engine_buffers": engine, "activations": model + unnamed}


def _check(
    world_size: int, rank: int | None, outer_dp_size: int, arguments: dict[str, Any]
) -> None:
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size={world_size!r}: give the number of ranks, an int >= 1")
    if rank is not None and not 0 <= rank < world_size:
        raise ValueError(f"rank={rank!r}: give a rank in [0, {world_size}) or None (the largest)")
    if outer_dp_size < 1 or world_size % outer_dp_size:
        raise ValueError(
            f"outer_dp_size={outer_dp_size!r} must divide world_size={world_size} (HSDP: that "
            "many replicas of world_size / outer_dp_size ranks)"
        )
    given = sorted(name for name in _BUILT_HERE if name in arguments)
    if given:
        raise ValueError(
            f"plan_memory runs on a fake world of its own, where {given} do not exist: give "
            "outer_dp_size= for HSDP, or pass a function building the model that returns "
            "(model, dict(device_mesh=..., ...)) made inside that world"
        )
    if dist.is_initialized():
        raise RuntimeError(
            "plan_memory runs the engine on torch's fake process group, in this process: call "
            "it before init_process_group, or from another process (python -m megatron_fsdp.plan)"
        )
