"""``plan_memory``: each rank's peak bytes through a training step, and where it occurs,
before a run: no process group, no parameter memory, any world size.

The plan follows one steady-state training step (forward, backward, optimizer step; the
gradients freed by the previous ``zero_grad()``):

* the model states (``model_states.py``): compute and main weights and optimizer state,
  live throughout, packed into the layouts ``fully_shard_model`` builds (HSDP, HFSDP, TP,
  EP and float8 codec groups included);
* forward and backward: one pass of the example input on a fake copy of the model
  (``fake_step.py``) counts the activations, and at every unit boundary ``ledger.py``
  charges the engine's buffers into the same count by the engine's rules (gathered
  weights at the prefetch depth, codec temporaries, unreduced gradients in the reduction
  window, gradient shards as reductions launch), so both peak together in the order they
  really interleave. Without an input the units run in registration order and the
  activations are absent;
* the optimizer step: every gradient, the state and the update's temporaries (three
  chunk-sized tensors for Adam/AdamW: the contiguous step's chunks on a CPU, a whole run on
  accelerators).

The peak is the largest phase total on the largest rank (ranks differ only in their
optimizer-state rows). Refused by name: fine-grained gathers, double buffers, NCCL user
buffers; an example input with DTensor or torchao float8 weights (plan those without one).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from megatron_fsdp.hybrid import parse_outer_strategy
from megatron_fsdp.plan.fake_step import LossFn, StepEvents, run_fake_step
from megatron_fsdp.plan.ledger import (
    CODEC,
    GATHERED,
    GRADIENTS,
    UNREDUCED,
    EngineLedger,
    UnitBuffers,
)
from megatron_fsdp.plan.model_states import (
    MODEL_STATE_CATEGORIES,
    ExpertPredicate,
    ModelStatesPlan,
    PlannedUnit,
    StateBytes,
    Topology,
    owned_parameters,
    plan_bytes,
    plan_model_states,
    topology_of,
)
from mfsdp_buffers import FlatLayout, LiveTensorTracker, PhaseMark
from mfsdp_collectives import check_post_forward_size
from mfsdp_hooks import (
    MixedPrecisionPolicy,
    UnitSpec,
    is_megatron_expert,
    local_tensor,
    parse_strategy,
)

__all__ = ["MEMORY_CATEGORIES", "MemoryPlan", "PhaseBytes", "plan_memory"]

MEMORY_CATEGORIES = (
    *MODEL_STATE_CATEGORIES,
    GATHERED,
    CODEC,
    UNREDUCED,
    "optimizer_temporaries",
    "activations",
)
"""The model states held between steps, then what lives only within a step."""

CPU_STEP_CHUNK = 1 << 18
"""Elements per chunk of the contiguous optimizer step on a CPU (``mfsdp_hooks``)."""

# fully_shard_model arguments that change nothing the plan counts.
_MEMORY_NEUTRAL = frozenset(
    {
        "average_in_collective",
        "gradient_scaling_factor",
        "calculate_per_token_loss",
        "report_nan_in_param_grad",
        "preproc_state_dict_for_dcp_ckpt",
        "use_decoupled_grad",
        "sync_model_each_microbatch",
        "init_model_with_meta_device",
        "overlap_grad_reduce",
        "device_mesh",
        "dp_shard_dim",
        "dp_outer_dim",
        "hybrid_fsdp_group",
    }
)


@dataclass(frozen=True)
class PhaseBytes:
    """The planned bytes of one segment of the step on the largest rank."""

    phase: str
    """``forward of blocks.0``, ``backward of <root>``, ``optimizer step``..."""
    categories: dict[str, int]

    @property
    def total(self) -> int:
        return sum(self.categories.values())


@dataclass(frozen=True)
class MemoryPlan:
    """Per-rank peak of a training step; ``str()`` is a table."""

    states: ModelStatesPlan
    phases: tuple[PhaseBytes, ...]
    has_activations: bool

    @property
    def _peak(self) -> PhaseBytes:
        return max(self.phases, key=lambda p: p.total)

    @property
    def peak_bytes(self) -> int:
        """The highest live bytes on the largest rank."""
        return self._peak.total

    @property
    def peak_phase(self) -> str:
        return self._peak.phase

    @property
    def categories(self) -> dict[str, int]:
        """Bytes by category at the peak (``activations`` only with an example input)."""
        return dict(self._peak.categories)

    @property
    def between_steps_bytes(self) -> int:
        """After ``optimizer.step()``: weights, gradients and optimizer state."""
        return self.states.between_steps_bytes

    def __str__(self) -> str:
        s = self.states
        lines = [
            f"memory per rank at world size {s.world_size}, ZeRO-{s.strategy} "
            f"(largest: rank {s.largest_rank})",
            f"  peak {plan_bytes(self.peak_bytes)} in {self.peak_phase}:",
        ]
        for name, nbytes in self.categories.items():
            lines.append(f"    {name:<22} {plan_bytes(nbytes)}")
        lines.append(f"  between steps {plan_bytes(self.between_steps_bytes)}")
        return "\n".join(lines)


def plan_memory(
    module: nn.Module | Callable[[], nn.Module],
    *,
    world_size: int,
    optimizer: str | StateBytes = "adamw",
    example_inputs: Sequence[Any] | None = None,
    example_kwargs: dict[str, Any] | None = None,
    loss_fn: LossFn | None = None,
    fsdp_unit_modules: Sequence[UnitSpec] | None = None,
    zero_dp_strategy: int | str = 3,
    mixed_precision_policy: MixedPrecisionPolicy | None = None,
    outer_dp_size: int = 1,
    outer_dp_sharding_strategy: int | str = 0,
    overlap_param_gather: bool = True,
    backward_prefetch_grad_fraction: float = 0.5,
    tp_size: int = 1,
    ep_size: int = 1,
    is_expert: ExpertPredicate = is_megatron_expert,
    device: torch.device | str = "cuda",
    host_transport: str = "auto",
    reshard_after_forward_group_size: int | None = None,
    **fully_shard_model_arguments: Any,
) -> MemoryPlan:
    """Plan the peak of ``module`` trained with ``fully_shard_model(module, ...)`` on each of
    ``world_size`` ranks (``outer_dp_size`` replicas of ``world_size / outer_dp_size`` for
    HSDP, HFSDP with ``outer_dp_sharding_strategy="optim"``).

    ``module``: a model, best on the meta device, or a function building one (called under
    ``torch.device("meta")``). ``example_inputs``/``example_kwargs``: one rank's batch (real
    or meta tensors); with them the activations are measured on a fake copy and
    ``loss_fn(output)`` (default: the sum of the floating outputs) is backpropagated;
    without them the plan has no activation category and assumes the units run in the
    order they are registered. ``tp_size``/``ep_size``/``is_expert``: tensor and expert
    parallelism, with ``module`` the model one rank holds (``plan_model_states``).
    ``reshard_after_forward_group_size``: each unit keeps ``1/size`` of its gathered weights
    from its forward to its backward (counted as gathered weights).
    ``device``: where the ranks train (``"cuda"``: gradients reduced through a buffer;
    ``"cpu"``: in place through shared memory unless ``host_transport="gloo"``).
    """
    _check_arguments(fully_shard_model_arguments)
    if not isinstance(module, nn.Module):
        with torch.device("meta"):
            module = module()
    strategy = int(parse_strategy(zero_dp_strategy, "zero_dp_strategy"))
    outer = parse_outer_strategy(outer_dp_sharding_strategy, strategy)
    topology = topology_of(world_size, outer_dp_size, outer, tp_size, ep_size)
    _check_group_size(reshard_after_forward_group_size, topology, strategy)
    policy = mixed_precision_policy or MixedPrecisionPolicy()
    states = plan_model_states(
        module,
        world_size=world_size,
        fsdp_unit_modules=fsdp_unit_modules,
        zero_dp_strategy=strategy,
        mixed_precision_policy=policy,
        optimizer=optimizer,
        outer_dp_size=outer_dp_size,
        outer_dp_sharding_strategy=outer,
        tp_size=tp_size,
        ep_size=ep_size,
        is_expert=is_expert,
    )
    target = torch.device(device)
    in_place = target.type == "cpu" and strategy != 0 and host_transport != "gloo"
    owners = owned_parameters(module, fsdp_unit_modules)
    sizes = {
        unit.name: _unit_buffers(unit, params, topology, strategy, policy)
        for unit, (_, params) in zip(states.units, owners, strict=True)
    }

    with_input = example_inputs is not None or example_kwargs is not None
    run = _step_runner(module, owners, example_inputs, example_kwargs, policy, loss_fn, target)
    # Prefetch follows the order the units ran in the previous step: start from the
    # registration order, and run again in the order seen if the model runs otherwise.
    forward = [name for name, _ in reversed(owners)]
    backward = ["", *reversed(forward[1:])]
    for _ in range(2):
        walked = EngineLedger(
            LiveTensorTracker(fake=True),
            sizes,
            forward_order=forward,
            backward_order=backward,
            overlap=overlap_param_gather,
            in_place=in_place,
            prefetch_fraction=backward_prefetch_grad_fraction,
            post_forward_size=reshard_after_forward_group_size,
        )
        run(walked, walked.tracker)
        if (walked.forward_seen, walked.backward_seen) == (forward, backward):
            break
        forward, backward = walked.forward_seen, walked.backward_seen
    phases = [_phase_bytes(name, mark, states, with_input) for name, mark in walked.phases]
    phases += _optimizer_phases(states, sizes, optimizer, target, with_input)
    return MemoryPlan(states, tuple(phases), has_activations=with_input)


StepRunner = Callable[[StepEvents, LiveTensorTracker], None]


def _step_runner(
    module: nn.Module,
    owners: Sequence[tuple[str, Sequence[nn.Parameter]]],
    example_inputs: Sequence[Any] | None,
    example_kwargs: dict[str, Any] | None,
    policy: MixedPrecisionPolicy,
    loss_fn: LossFn | None,
    device: torch.device,
) -> StepRunner:
    """One step's events: from a fake run of the example input, or without one from the
    units' registration order."""
    if example_inputs is None and example_kwargs is None:
        return lambda events, tracker: _registered_step(events, module, owners)

    def run(events: StepEvents, tracker: LiveTensorTracker) -> None:
        run_fake_step(
            module,
            owners,
            tuple(example_inputs or ()),
            example_kwargs,
            policy=policy,
            loss_fn=loss_fn,
            device=_fake_device(device),
            events=events,
            tracker=tracker,
        )

    return run


def _fake_device(device: torch.device) -> torch.device:
    """Where the fake step runs: ``device``, or the CPU where this torch cannot fake it (a
    CPU-only build aborts on fake CUDA autograd); the shapes, hence the bytes, are the same
    but for kernels that save device-specific tensors (attention)."""
    if device.type == "cpu" or (device.type == "cuda" and torch.cuda.is_available()):
        return device
    return torch.device("cpu")


def _check_group_size(size: int | None, topology: Topology, strategy: int) -> None:
    if size is None:
        return
    check_post_forward_size(size, topology.shard, "reshard_after_forward_group_size")
    if strategy != 3 or topology.ep > 1:
        raise NotImplementedError(
            "plan_memory with reshard_after_forward_group_size plans ZeRO-3 without expert "
            "parallelism only (the engine keeps no slices otherwise): drop one of them"
        )


def _check_arguments(arguments: dict[str, Any]) -> None:
    unplanned = sorted(set(arguments) - _MEMORY_NEUTRAL)
    if unplanned:
        raise NotImplementedError(
            f"plan_memory does not take {unplanned}: tensor and expert parallelism are "
            "planned from sizes (tp_size=, ep_size=, with the model one rank holds), and "
            "FP8 weights, fine-grained gathers, double buffers and NCCL user buffers are not "
            "modelled yet: plan without them, or measure with mfsdp_buffers.LiveTensorTracker"
        )


def _unit_buffers(
    unit: PlannedUnit,
    params: Sequence[nn.Parameter],
    topology: Topology,
    strategy: int,
    policy: MixedPrecisionPolicy,
) -> UnitBuffers:
    gathered = reduce_buffer = shard = partial = scratch = 0
    for group in unit.groups:
        layout = group.layout(topology)
        compute = group.compute_dtype(policy)
        if strategy == 3:
            gathered += layout.padded_numel * compute.itemsize
            if group.wire_dtype is not None:  # abs() in the main dtype, then the bytes
                rows = _largest_piece(layout)
                main = policy.optimizer_dtype(group.dtype).itemsize
                scratch = max(scratch, rows * (main + group.wire_dtype.itemsize))
        if not group.requires_grad:
            continue
        reduce_buffer += layout.padded_numel * policy.grad_reduce_dtype(group.dtype).itemsize
        optim_layout = group.optim_layout(topology)
        numel = optim_layout.shard_numel if strategy >= 1 else optim_layout.padded_numel
        shard += numel * policy.grad_dtype(group.dtype).itemsize
        if topology.hfsdp:
            partial += layout.shard_numel * policy.grad_dtype(group.dtype).itemsize
    grads = [local_tensor(p).numel() for p in params if p.requires_grad]  # TP: this rank's
    itemsizes = [policy.compute_dtype(p.dtype).itemsize for p in params if p.requires_grad]
    return UnitBuffers(
        gathered=gathered,
        grad_bytes=tuple(n * size for n, size in zip(grads, itemsizes, strict=True)),
        grad_elements=tuple(grads),
        reduce_buffer=reduce_buffer,
        grad_shard=shard,
        partial=partial,
        codec_scratch=scratch,
    )


def _largest_piece(layout: FlatLayout) -> int:
    """The most elements of one parameter in one rank's shard."""
    size = layout.shard_numel
    if size == 0:
        return 0
    return max(
        (min(size, p.numel, p.end - (p.offset // size) * size) for p in layout.placements),
        default=0,
    )


def _registered_step(
    events: StepEvents, module: nn.Module, owners: Sequence[tuple[str, Sequence[nn.Parameter]]]
) -> None:
    """With no input: the root's forward around each unit's in registration order, then the
    backward in reverse. The root's gradients registered before every unit's (an input
    embedding's) arrive last, the others (an output head's) first."""
    inner = [name for name, _ in reversed(owners) if name]
    position = {id(p): i for i, p in enumerate(module.parameters())}
    unit_positions = [position[id(p)] for name, params in owners if name for p in params]
    first_unit = min(unit_positions, default=len(position))
    root = list(enumerate(p for p in dict(owners)[""] if p.requires_grad))
    late = [i for i, p in root if position[id(p)] < first_unit]
    events.forward_start("")
    for name in inner:
        events.forward_start(name)
        events.forward_end(name)
    events.forward_end("")
    events.loss_start()
    events.backward_start("")
    for index, _ in root:
        if index not in late:
            events.grad_arrived("", index)
    for name, params in owners[:-1]:
        events.backward_start(name)
        for index in range(sum(p.requires_grad for p in params)):
            events.grad_arrived(name, index)
    for index in late:
        events.grad_arrived("", index)
    events.backward_end()


def _phase_bytes(
    name: str, mark: PhaseMark, states: ModelStatesPlan, with_activations: bool
) -> PhaseBytes:
    """A phase's peak by category: the model states, what the ledger charged at that
    moment, and the rest of the tracker's count, the activations."""
    by_site = mark.peak_by_site or {}
    charged = {site: by_site.get(site, 0) for site in (GATHERED, CODEC, UNREDUCED, GRADIENTS)}
    model = states.categories
    categories = {
        "compute_weights": model["compute_weights"],
        "main_weights": model["main_weights"],
        "optimizer_state": model["optimizer_state"],
        "gradients": charged[GRADIENTS],
        "gathered_weights": charged[GATHERED],
        "codec_buffers": charged[CODEC],
        "unreduced_gradients": charged[UNREDUCED],
        "optimizer_temporaries": 0,
    }
    if with_activations:
        categories["activations"] = mark.peak - sum(charged.values())
    return PhaseBytes(name, categories)


def _optimizer_phases(
    states: ModelStatesPlan,
    sizes: dict[str, UnitBuffers],
    optimizer: str | StateBytes,
    device: torch.device,
    with_activations: bool,
) -> list[PhaseBytes]:
    """The step: every gradient, the state (the first step creates it chunk by chunk, its
    peak is the later steps') and the update's temporaries."""
    model = states.categories
    run = max((s.grad_shard // 4 for s in sizes.values()), default=0)
    stateless = isinstance(optimizer, str) and optimizer.lower() == "sgd"
    chunk = min(run, CPU_STEP_CHUNK) if device.type == "cpu" else run
    categories = {name: model[name] for name in MODEL_STATE_CATEGORIES}
    categories["gathered_weights"] = categories["unreduced_gradients"] = 0
    categories["codec_buffers"] = 0
    categories["optimizer_temporaries"] = 0 if stateless else 3 * chunk * 4
    if with_activations:
        categories["activations"] = 0
    return [PhaseBytes("optimizer step", categories)]
