"""One rank of a world, run for real on fake tensors: what ``plan_memory`` reads its plan off
(how: the package README, "Will it fit?"). Nothing here restates a rule of the engine.

The step is run twice: the first creates the optimizer state (torch's optimizers create it
lazily), the second is the steady state a training run repeats and is the one recorded.
What a fake world cannot run is modelled in ``run_route``, the one place that does so.
"""

from __future__ import annotations

import copy
import gc
from collections.abc import Callable, Iterable, Sequence
from contextlib import nullcontext
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import nn
from torch._subclasses.fake_tensor import DataDependentOutputException, DynamicOutputShapeException
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.utils._pytree import tree_map

import mfsdp_buffers
import mfsdp_collectives
import mfsdp_hooks
from megatron_fsdp.api import fully_shard_model, fully_shard_optimizer
from mfsdp_buffers import LiveTensorTracker, PhaseMark
from mfsdp_collectives import RealMeshesFakeMode
from mfsdp_hooks import (
    ACCELERATOR_CHUNK_NUMEL,
    ShardingSummary,
    describe,
    forced_host_copies,
    fsdp_units,
    heaviest_rank,
    record_timeline,
)

__all__ = [
    "ENGINE",
    "ModelSource",
    "OptimizerSpec",
    "RankRun",
    "RunRoute",
    "run_rank",
    "run_route",
]

ModelSource = nn.Module | Callable[[], nn.Module | tuple[nn.Module, dict[str, Any]]]
"""A model (meta or real: its tensors are copied as fake ones), or a function run in the
fake world, under ``torch.device("meta")``, that builds it as the training script does: it
returns the model, or the model and the ``fully_shard_model`` arguments it goes with (the
meshes and groups it made: ``device_mesh``, ``expt_device_mesh``, ``tp_dim``...)."""

OptimizerFactory = Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]
OptimizerSpec = str | OptimizerFactory
"""``"adamw"``, ``"adam"``, ``"sgd"`` (lr 1e-3, torch's defaults otherwise), or a function
building the optimizer from the parameters (``lambda ps: torch.optim.AdamW(ps, lr=3e-4)``)."""

_OPTIMIZERS: dict[str, OptimizerFactory] = {
    "adamw": lambda params: torch.optim.AdamW(params, lr=1e-3),
    "adam": lambda params: torch.optim.Adam(params, lr=1e-3),
    "sgd": lambda params: torch.optim.SGD(params, lr=1e-3),
}

ENGINE = "engine"
"""The site of every storage the engine's own code made (the other site is ``MODEL``)."""
MODEL = "model"
_ENGINE_PACKAGES = (mfsdp_buffers, mfsdp_collectives, mfsdp_hooks)
_ENGINE_DIRS = tuple(str(Path(str(package.__file__)).parent) for package in _ENGINE_PACKAGES)


def _site(path: str, function: str) -> str:
    return ENGINE if path.startswith(_ENGINE_DIRS) else MODEL


@dataclass(frozen=True)
class RunRoute:
    """How the run differs from one on ``device`` where a fake world cannot tell."""

    run_device: torch.device
    """Where the fake tensors live: ``device``, or the CPU where this torch cannot fake it
    (a CPU-only build aborts on fake CUDA autograd); the shapes, hence the bytes, are the
    same but for kernels that save device-specific tensors (attention)."""
    host_transport: str
    """The engine's CPU reductions on one host read the gradients in place through shared
    memory (a fake world gets a transport that takes that route, moving nothing); on an
    accelerator they go through a reduce buffer, the route c10d takes on a CPU too."""
    granularity: int
    """CUDA's caching allocator hands out 512-byte blocks (what ``max_memory_allocated``
    counts); a CPU tensor takes its bytes."""
    step_chunk_numel: int | None
    """The contiguous optimizer step takes CPU tensors in cache-sized chunks, an
    accelerator's runs whole: the fake run on a CPU takes the accelerator's choice."""
    forced_host_copies: bool = False
    """The CPU stands in for the accelerator: host offload's copies are forced, as there
    (``forced_host_copies``; ``mfsdp_buffers.residence`` tells its host buffers apart)."""


def run_route(device: torch.device, host_transport: str) -> RunRoute:
    """The one place that models what the engine does on ``device`` and a fake run cannot
    see. Not modelled: streams holding a buffer past its last use on the host, the caching
    allocator's fragmentation and its reserved-but-unallocated memory."""
    if device.type == "cpu":
        return RunRoute(device, host_transport, 1, None)
    faked = device if device.type == "cuda" and torch.cuda.is_available() else torch.device("cpu")
    forced = faked.type == "cpu"
    return RunRoute(faked, "gloo", 512, ACCELERATOR_CHUNK_NUMEL, forced)


@dataclass(frozen=True)
class RankRun:
    """What one rank held through its recorded step."""

    rank: int
    start: PhaseMark
    """Live bytes (and by site) as the step starts: what persists from step to step."""
    segments: tuple[PhaseMark, ...]
    """Each segment of the step, in order, with its peak (and by site at that peak)."""
    between_steps: int
    """Live bytes after ``optimizer.step()``, before ``zero_grad`` (on the device)."""
    host_between: int
    """The same on the host (host offload's main weights, gradients, optimizer state)."""
    states: ShardingSummary
    """``describe`` of the rank with its optimizer, after the step."""
    largest_rank: int
    """The rank to plan: the one whose shards hold the most (``heaviest_rank``)."""


def run_rank(
    module: ModelSource,
    *,
    rank: int,
    world_size: int,
    meshes: Callable[[str], dict[str, Any]] | None,
    optimizer: OptimizerFactory,
    inputs: tuple[Sequence[Any], dict[str, Any]],
    loss_fn: Callable[[Any], torch.Tensor] | None,
    route: RunRoute,
    wrap_arguments: dict[str, Any],
    after_wrap: Callable[[nn.Module], object] | None = None,
) -> RankRun:
    """Run two training steps of ``rank`` of ``world_size`` on fake tensors (see the module).
    ``meshes(device_type)``: wrap arguments made in the fake world (HSDP's mesh)."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    # The run makes hundreds of thousands of fake tensors: each full collection would walk
    # every object the process already holds (torch, the model's library) for nothing.
    gc.freeze()
    try:
        arguments = dict(wrap_arguments, host_transport=route.host_transport)
        arguments.update(meshes(route.run_device.type) if meshes is not None else {})
        model, made = _built(module)  # meshes on real tensors, before the fake mode
        arguments.update(made)
        owned = not isinstance(module, nn.Module)
        with RealMeshesFakeMode(allow_non_fake_inputs=True) as mode:
            offload = bool(wrap_arguments.get("optimizer_cpu_offload"))
            tracker = LiveTensorTracker(
                True,
                fake=True,
                name_site=_site,
                granularity=route.granularity,
                # Only host offload puts states on the host; a run without it skips the
                # per-storage question (a 70B plan makes ~70k storages).
                device=route.run_device if offload else None,
            )
            with tracker:
                model = _fake_model(model, owned=owned, mode=mode, device=route.run_device)
                if route.run_device.type != "cpu":  # the fake tensors are made there already
                    arguments["device"] = route.run_device
                with forced_host_copies() if route.forced_host_copies else nullcontext():
                    sharded = fully_shard_model(model, **arguments)
                del model
                if after_wrap is not None:
                    after_wrap(sharded)
                built = optimizer(sharded.parameters())
                attached = fully_shard_optimizer(built, step_chunk_numel=route.step_chunk_numel)
                batch = _fake_inputs(inputs, mode, route.run_device)
                step = partial(_train_step, sharded, attached, batch, loss_fn or default_loss)
                step()
                attached.zero_grad()
                gc.collect()
                return _recorded_step(step, sharded, attached, tracker, rank)
    finally:
        gc.unfreeze()
        dist.destroy_process_group()


def _train_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    inputs: tuple[Sequence[Any], dict[str, Any]],
    loss_fn: Callable[[Any], torch.Tensor],
) -> None:
    """One training step of the sharded model: forward, the loss, backward, the optimizer."""
    args, kwargs = inputs
    try:
        loss = loss_fn(model(*args, **kwargs))
    except (DataDependentOutputException, DynamicOutputShapeException) as error:
        raise NotImplementedError(
            f"plan_memory: the model's forward makes a shape from the data ({error}; "
            "e.g. a mixture of experts counting the tokens each expert gets), which a "
            "run on fake tensors cannot know: plan it with routing of a fixed capacity, "
            "or measure one real rank with mfsdp_buffers.LiveTensorTracker"
        ) from error
    torch.autograd.backward(loss)
    optimizer.step()


def _recorded_step(
    step: Callable[[], None],
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    tracker: LiveTensorTracker,
    rank: int,
) -> RankRun:
    tracker.reset_phase()  # the mark's peak is then now: its sites are what is live now
    start = tracker.mark("before the step")
    segments: list[PhaseMark] = []
    current = ["before the step"]

    def on_segment(name: str) -> None:
        segments.append(tracker.mark(current[0]))
        current[0] = name

    units = fsdp_units(model)
    with record_timeline(units, optimizer, on_segment=on_segment, profiler_ranges=False):
        step()
        segments.append(tracker.mark(current[0]))
    between, host_between = tracker.live, tracker.host_live
    states = describe(model, optimizer)
    optimizer.zero_grad()
    largest = heaviest_rank(model)
    return RankRun(rank, start, tuple(segments[1:]), between, host_between, states, largest)


def default_loss(output: Any) -> torch.Tensor:
    """The loss of a model's output when none is given: its ``loss`` (a Hugging Face model
    given labels), else the output (or its first element) summed."""
    loss = getattr(output, "loss", None)
    if loss is None:
        loss = output[0] if isinstance(output, list | tuple) else output
    if not isinstance(loss, torch.Tensor) or not loss.is_floating_point():
        raise ValueError(
            f"loss_fn: found no floating-point tensor to backpropagate in the model's output "
            f"({type(output).__name__}); pass loss_fn=lambda output: ... returning the loss"
        )
    return loss.float().sum()


def optimizer_factory(spec: object) -> OptimizerFactory:
    """The function building ``spec``'s optimizer from the parameters (``OptimizerSpec``);
    refuses one ``plan_memory`` cannot build, naming the choices."""
    if isinstance(spec, str) and spec.lower() in _OPTIMIZERS:
        return _OPTIMIZERS[spec.lower()]
    if callable(spec) and not isinstance(spec, str):
        return cast(OptimizerFactory, spec)
    raise ValueError(
        f"optimizer={spec!r}: give one of {sorted(_OPTIMIZERS)} or a function building the "
        "optimizer from the parameters (lambda params: torch.optim.AdamW(params, lr=3e-4))"
    )


def _built(module: ModelSource) -> tuple[nn.Module, dict[str, Any]]:
    """The model, and the wrap arguments its builder made (``ModelSource``)."""
    if isinstance(module, nn.Module):
        return module, {}
    with torch.device("meta"):
        built = module()
    match built:
        case nn.Module():
            return built, {}
        case (nn.Module() as model, dict() as made):
            return model, dict(made)
    raise TypeError(
        f"module: the builder returned {type(built).__name__}; return the model, or "
        "(model, dict of fully_shard_model arguments such as device_mesh=...)"
    )


def _fake_model(module: nn.Module, *, owned: bool, mode: Any, device: torch.device) -> nn.Module:
    """``module`` with fake parameters and buffers of the same shapes (DTensors stay
    DTensors: tensor parallelism keeps its layout), tied ones still tied. A model the caller
    passed is copied first (its modules, not its tensors, meshes or groups) and left as it
    was; one a builder made for the plan (``owned``) is changed in place."""
    fakes: dict[int, torch.Tensor] = {}
    for tensor in [*module.parameters(), *module.buffers()]:
        fake = _fake_like(tensor, mode, device)
        fakes[id(tensor)] = (
            nn.Parameter(fake, tensor.requires_grad) if isinstance(tensor, nn.Parameter) else fake
        )
    if not owned:
        memo: dict[int, Any] = dict(fakes)
        for sub in module.modules():  # a process group does not copy: the copy shares it
            for value in vars(sub).values():
                if isinstance(value, dist.ProcessGroup | DeviceMesh):
                    memo[id(value)] = value
        return copy.deepcopy(module, memo)
    for sub in module.modules():
        own = [*sub.named_parameters(recurse=False), *sub.named_buffers(recurse=False)]
        for name, value in own:
            setattr(sub, name, fakes[id(value)])
    return module


def _fake_like(tensor: torch.Tensor, mode: Any, device: torch.device) -> torch.Tensor:
    if isinstance(tensor, DTensor):
        local = _fake_like(tensor.to_local(), mode, device)
        return DTensor.from_local(
            local,
            tensor.device_mesh,
            tensor.placements,
            run_check=False,
            shape=tensor.shape,
            stride=tensor.stride(),
        )
    if tensor.device.type == "meta":
        return torch.empty(tensor.shape, dtype=tensor.dtype, device=device)
    fake: torch.Tensor = mode.from_tensor(tensor)
    return fake.to(device)


def _fake_inputs(
    inputs: tuple[Sequence[Any], dict[str, Any]], mode: Any, device: torch.device
) -> tuple[Sequence[Any], dict[str, Any]]:
    def fake(value: Any) -> Any:
        if not isinstance(value, torch.Tensor):
            return value
        if value.device.type == "meta" and not value.is_floating_point():
            return torch.zeros(value.shape, dtype=value.dtype, device=device)
        return _fake_like(value, mode, device)

    return tree_map(fake, list(inputs[0])), tree_map(fake, dict(inputs[1]))
