"""Shared by the pipeline-parallelism tests (issue 28): the toy model cut into pipeline
stages, each sharded over its data-parallel ranks (a ``dp_shard`` pair, or HSDP's
``(dp_outer, dp_shard)`` square), trained with torch's schedules through
``mfsdp_hooks.PipelineStage`` and compared with one process on the whole model.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import os
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.pipelining import (
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleInterleavedZeroBubble,
    ScheduleLoopedBFS,
    ScheduleZBVZeroBubble,
)
from torch.distributed.tensor import DTensor

import mfsdp_hooks
from mfsdp_buffers import LiveTensorTracker
from mfsdp_collectives import CommTracer
from mfsdp_hooks import FSDPRootWrapper, PipelineStage, ShardingOptions, sharded_roots
from mfsdp_hooks.testing import (
    Block,
    ToyModel,
    assert_close_rel,
    local_slice,
    loss_fn,
    make_batches,
    make_model,
    train_single_process,
)

RTOL = 1e-5
STEPS = 10
N_BLOCKS = 4
GLOBAL_BATCH = 16  # 8 rows per DP rank of a pair (4 micro-batches of 2, or 8 of 1), 4 under HSDP
PP = 2
TIMEOUT = 240
FULL = os.environ.get("MFSDP_FULL_MATRIX") == "1"

# name -> (schedule class, stages per rank); the zero-bubble ones split each backward into
# its input-gradient pass (I) and, later, its weight-gradient pass (W).
SCHEDULES: dict[str, tuple[Any, int]] = {
    "gpipe": (ScheduleGPipe, 1),
    "1f1b": (Schedule1F1B, 1),
    "interleaved1f1b": (ScheduleInterleaved1F1B, 2),
    "loopedbfs": (ScheduleLoopedBFS, 2),
    "interleaved_zb": (ScheduleInterleavedZeroBubble, 2),
    "zbv": (ScheduleZBVZeroBubble, 2),
}
SPLIT_BACKWARD = {"interleaved_zb", "zbv"}
V_SHAPED = {"zbv"}  # rank r holds stages r and 2 * PP - 1 - r (else r and r + PP)
# per_module: mfsdp_hooks.fully_shard on each block, then the stage root.
# root_wrapper: FSDPRootWrapper over the stage with ShardingOptions, what the seed API's
#   fully_shard_model builds (its Megatron-FSDP no_sync would reduce-scatter each micro-batch
#   under ZeRO-2/3; the PipelineStage keeps gradients to the step's end instead), and an
#   attached optimizer (what fully_shard_optimizer attaches).
# root_wrapper_rs_each_mb: the same with PipelineStage(..., reduce_scatter_each_microbatch=
#   True): ZeRO-2/3 reduce-scatter every micro-batch.
RS_EACH_MB = "root_wrapper_rs_each_mb"


@dataclass(frozen=True)
class DataParallel:
    """This rank's data-parallel place: the mesh its stages' units shard over (``dp_shard``,
    or ``(dp_outer, dp_shard)`` for HSDP), the group of all its DP ranks, and its rank
    among them (which rows of the global batch it takes)."""

    mesh: DeviceMesh
    group: dist.ProcessGroup
    rank: int
    size: int

    @property
    def hsdp(self) -> bool:
        return self.mesh.ndim == 2


def make_meshes(hsdp: bool) -> tuple[DeviceMesh, DataParallel]:
    """The ``pp`` mesh and this rank's DP place: pp=2 x dp=2 on 4 ranks, or pp=2 x
    (dp_outer=2 x dp_shard=2) on 8."""
    if not hsdp:
        mesh = init_device_mesh("cpu", (PP, 2), mesh_dim_names=("pp", "dp_shard"))
        dp_mesh = mesh["dp_shard"]
        rank = dp_mesh.get_local_rank()
        return mesh["pp"], DataParallel(dp_mesh, dp_mesh.get_group(), rank, 2)
    names = ("pp", "dp_outer", "dp_shard")
    mesh = init_device_mesh("cpu", (PP, 2, 2), mesh_dim_names=names)
    # The 4 ranks of each stage's DP square (every rank creates every group, in order).
    groups = [dist.new_group(list(range(p * 4, p * 4 + 4))) for p in range(PP)]
    dp_mesh = mesh["dp_outer", "dp_shard"]
    rank = 2 * dp_mesh.get_local_rank("dp_outer") + dp_mesh.get_local_rank("dp_shard")
    return mesh["pp"], DataParallel(dp_mesh, groups[mesh["pp"].get_local_rank()], rank, 4)


def shard_stage(
    stage: Stage, api: str, zero: int, dp: DataParallel, keep_weights: bool
) -> nn.Module:
    if api == "per_module":
        # keep_weights: torchtitan's PP choice, reshard_after_forward=False on every unit.
        # A 2-D mesh is HSDP, FSDP2's convention: (replicate, shard).
        options: dict[str, Any] = {"reshard_after_forward": False} if keep_weights else {}
        for block in stage.blocks:
            mfsdp_hooks.fully_shard(block, mesh=dp.mesh, sharding_strategy=zero, **options)
        return mfsdp_hooks.fully_shard(stage, mesh=dp.mesh, sharding_strategy=zero, **options)  # type: ignore[no-any-return]
    if api not in ("root_wrapper", RS_EACH_MB):
        raise ValueError(f"unknown api {api!r}")
    # A 2-D (dp_outer, dp_shard) mesh is HSDP here too.
    options_record = ShardingOptions(zero_dp_strategy=zero, device_mesh=dp.mesh)
    return FSDPRootWrapper(stage, fsdp_unit_modules=[Block], options=options_record)


class Stage(nn.Module):
    """A contiguous slice of the toy model: the embedding (first stage), blocks, the heads
    (last stage). It shares the model's modules, so names map back to the model's."""

    def __init__(self, model: ToyModel, blocks: range, first: bool, last: bool) -> None:
        super().__init__()
        self.first, self.last = first, last
        if first:
            self.embed, self.frozen = model.embed, model.frozen
        self.blocks = nn.ModuleList(model.blocks[i] for i in blocks)
        if last:
            self.head, self.value = model.head, model.value

    def forward(self, x: torch.Tensor) -> Any:
        if self.first:
            x = self.frozen(self.embed(x))
        for block in self.blocks:
            x = block(x)
        if self.last:
            return self.head(x), self.value(x)
        return x


def untied_model() -> ToyModel:
    """The toy model with its head a parameter of its own (same initial values)."""
    model = make_model(0, n_blocks=N_BLOCKS)
    model.head.weight = nn.Parameter(model.embed.weight.detach().clone())
    return model


def _adamw(params: Any) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)


@functools.cache
def reference() -> tuple[list[float], dict[str, torch.Tensor]]:
    model = untied_model()
    trainable = [p for p in model.parameters() if p.requires_grad]
    losses = train_single_process(model, _adamw(trainable), make_batches(STEPS, GLOBAL_BATCH))
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


def _stage_names(stage: nn.Module, model: nn.Module) -> dict[str, str]:
    """Each of the stage's state-dict keys -> the whole model's key for the same tensor."""
    by_id = {id(v): k for k, v in model.state_dict(keep_vars=True).items()}
    return {k: by_id[id(v)] for k, v in stage.state_dict(keep_vars=True).items()}


@dataclass
class RankStages:
    """This rank's stages of the pipeline, sharded over its DP ranks."""

    stages: list[PipelineStage] = field(default_factory=list)
    models: list[nn.Module] = field(default_factory=list)  # what each stage runs
    names: list[dict[str, str]] = field(default_factory=list)  # gathered key -> model's key
    units: int = 0  # units that own trainable parameters: each reduces once per step


def stage_indices(pp_rank: int, per_rank: int, v_shaped: bool) -> list[int]:
    if v_shaped:
        return [pp_rank, 2 * PP - 1 - pp_rank]
    return list(range(pp_rank, PP * per_rank, PP))


def build_stages(
    pp_mesh: DeviceMesh,
    dp: DataParallel,
    schedule_name: str,
    api: str,
    zero: int,
    keep_weights: bool,
) -> RankStages:
    per_rank = SCHEDULES[schedule_name][1]
    n_stages = PP * per_rank
    model = untied_model()
    blocks_per_stage = N_BLOCKS // n_stages
    built = RankStages()
    pp_rank = pp_mesh.get_local_rank()
    for index in stage_indices(pp_rank, per_rank, schedule_name in V_SHAPED):
        cut = range(index * blocks_per_stage, (index + 1) * blocks_per_stage)
        first, last = index == 0, index == n_stages - 1
        stage_module = Stage(model, cut, first=first, last=last)
        local_names = _stage_names(stage_module, model)
        sharded = shard_stage(stage_module, api, zero, dp, keep_weights)
        prefix = "module." if sharded is not stage_module else ""
        built.names.append({prefix + k: v for k, v in local_names.items()})
        # Each block, and the stage root where it holds the embedding or the heads (a
        # middle stage's root owns no parameter and reduces nothing).
        own = len(cut) + (first or last)
        built.units += own
        built.models.append(sharded)
        group = pp_mesh.get_group()
        built.stages.append(
            PipelineStage(
                sharded,
                index,
                n_stages,
                torch.device("cpu"),
                group=group,
                reduce_scatter_each_microbatch=api == RS_EACH_MB,
            )
        )
    return built


def pipeline_worker(
    rank: int,
    world: int,
    schedule_name: str,
    zero: int,
    api: str,
    micro: int,
    keep_weights: bool = False,
    track_memory: bool = False,
    hsdp: bool = False,
) -> dict[str, Any]:
    """Train one case on this rank; its losses, final weights and per-step counts. With
    ``track_memory`` live tensor bytes are counted from before the model is built
    (``live_after_step``; the tracker slows every op down about 3x)."""
    with LiveTensorTracker() if track_memory else contextlib.nullcontext() as memory:
        pp_mesh, dp = make_meshes(hsdp)
        built = build_stages(pp_mesh, dp, schedule_name, api, zero, keep_weights)
        # One optimizer per stage model (the seed's optimizer checkpoints belong to one model).
        optimizers = [_adamw([p for p in m.parameters() if p.requires_grad]) for m in built.models]
        if api != "per_module":
            for optimizer in optimizers:
                mfsdp_hooks.attach_optimizer(optimizer)
        schedule_cls, per_rank = SCHEDULES[schedule_name]
        stages: Any = built.stages[0] if per_rank == 1 else built.stages
        schedule = schedule_cls(stages, n_microbatches=micro, loss_fn=loss_fn)
        result = train(built, schedule, optimizers, dp, memory)
    result.update(
        weights=final_weights(built),
        units=built.units,
        # torch's pipelining recognises FSDP by this class (its UNSHARD/RESHARD actions).
        torch_fsdp_roots=[
            isinstance(root, torch.distributed.fsdp.FSDPModule)
            for m in built.models
            for root in sharded_roots(m)
        ],
    )
    return result


def train(
    built: RankStages,
    schedule: Any,
    optimizers: list[torch.optim.Optimizer],
    dp: DataParallel,
    memory: LiveTensorTracker | None,
) -> dict[str, Any]:
    """``STEPS`` schedule steps, each followed by the optimizers' step and zero_grad."""
    has_first = any(s.is_first for s in built.stages)
    has_last = any(s.is_last for s in built.stages)
    counts: dict[str, list[int]] = {op: [] for op in ("reduce_scatter", "all_reduce", "all_gather")}
    losses, live = [], []
    for tokens, targets in make_batches(STEPS, GLOBAL_BATCH):
        args = (local_slice(tokens, dp.rank, dp.size),) if has_first else ()
        step_losses: list[torch.Tensor] = []
        kwargs: dict[str, Any] = {}
        if has_last:
            kwargs = {"target": local_slice(targets, dp.rank, dp.size), "losses": step_losses}
        with CommTracer() as tracer:
            schedule.step(*args, **kwargs)
        for op, per_step in counts.items():
            per_step.append(tracer.calls(op))
        for optimizer in optimizers:
            optimizer.step()
            optimizer.zero_grad()
        if has_last:
            losses.append(_global_loss(step_losses, dp))
        del step_losses, kwargs
        if memory is not None:
            gc.collect()
            live.append(memory.live)
    return {
        "losses": losses,
        "reduce_scatters": counts["reduce_scatter"],
        "all_reduces": counts["all_reduce"],
        "all_gathers": counts["all_gather"],
        "live_after_step": live,
        "holds_first_stage": int(has_first),
    }


def _global_loss(micro_losses: list[torch.Tensor], dp: DataParallel) -> float:
    """The step's loss over the global batch: the mean over micro-batches and DP ranks."""
    total = torch.stack(micro_losses).mean().detach()
    dist.all_reduce(total, group=dp.group)
    return total.item() / dp.size


def final_weights(built: RankStages) -> dict[str, list[Any]]:
    """Every parameter of this rank's stages, full, under the whole model's names (plain
    lists: tensors sent back from a rank would die with it). Collective over the DP ranks."""
    weights: dict[str, list[Any]] = {}
    for model, names in zip(built.models, built.names, strict=True):
        for key, value in model.state_dict().items():
            full = value.full_tensor() if isinstance(value, DTensor) else value
            weights[names[key]] = full.float().tolist()
    return weights


def assert_same_memory_after_each_step(live: list[int], what: str) -> None:
    """Nothing of a step outlives it: live tensor bytes after each step (optimizer state
    included) stay within a few scalars (torch's pipelining keeps one or two between steps)
    of those after the first; a leaked gathered block or gradient buffer is over 1 KiB."""
    assert len(live) == STEPS and max(live) - min(live) <= 64, f"{what}: {live}"


def assert_matches_one_process(result: dict[str, Any], what: str) -> set[str]:
    """This rank's losses (last stage) and final weights against one process; returns the
    names of the weights it checked."""
    want_losses, want_weights = reference()
    if result["losses"]:
        got = torch.tensor(result["losses"], dtype=torch.float64)
        assert_close_rel(got, torch.tensor(want_losses, dtype=torch.float64), RTOL, what)
    for name, value in result["weights"].items():
        assert_close_rel(torch.tensor(value), want_weights[name], RTOL, f"{what}: {name}")
    return set(result["weights"])
