"""Step an elementwise optimizer over contiguous runs of sharded parameters, not one by one.

A group's sharded main weights are views into one flat buffer, and after a reduction their
gradients are views into one flat gradient buffer, in the same order. Adam, AdamW and SGD
update every element on its own, so one call on a flat view over a run of such parameters
computes, bit for bit, what one call per parameter computes, on plain tensors instead of
DTensors. Runs are cut into chunks of ``chunk_numel`` elements: on a CPU a chunk that stays
in cache makes the optimizer's several passes over it cheaper.

``optimizer.state[p]`` keeps the layout torch and checkpointing expect: views, shaped like
``p``, into the run's flat state buffers, and one step counter shared by the run. A run whose
picture breaks (a gradient the user replaced or dropped, state loaded from a checkpoint)
re-adopts what is consistent, or takes torch's per-parameter loop for that step.

During ``step()`` the groups' ``"params"`` lists hold the chunks, so optimizer step hooks
see chunks there; the lists are restored before ``step()`` returns, or raises.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch

from mfsdp_hooks.dtensor.dtensor_views import local_tensor
from mfsdp_hooks.optim.run_state import (
    counters_per_parameter,
    flat_over,
    split_state,
    tensor_entries,
    view_like,
)

CONTIGUOUS_STEP_OPTIMIZERS: tuple[type[torch.optim.Optimizer], ...] = (
    torch.optim.Adam,
    torch.optim.AdamW,
    torch.optim.SGD,
)
"""Exact types whose step on a flat view is tested bit-identical to their per-parameter step.

A subset of ``runtime.elementwise_optimizers.TORCH_ELEMENTWISE``, the optimizers allowed to
step sharded parameters at all (a test keeps the two from drifting apart); the others on
that list take torch's per-parameter loop.
"""

CPU_CHUNK_NUMEL = 1 << 18
"""Elements per chunk on CPU: 1 MiB of fp32, so each of the optimizer's passes hits cache."""
ACCELERATOR_CHUNK_NUMEL = 1 << 62
"""On an accelerator a run steps whole: one kernel per pass (launches, not cache, cost)."""


@dataclass
class _Run:
    """Parameters whose local weights tile one flat buffer, and the run's optimizer state."""

    params: list[torch.Tensor]
    offsets: list[int]
    weights: torch.Tensor
    chunk_bounds: list[tuple[int, int]]
    chunks: list[torch.Tensor] = field(init=False)
    flats: dict[str, torch.Tensor] | None = None
    """Elementwise state over the whole run, by key; None before the run's first step."""
    scalars: dict[str, torch.Tensor] = field(default_factory=dict)
    """State shared by the whole run (the step counter), by key."""
    order: tuple[str, ...] = ()
    """Every state key, in the order torch created them (``step``, ``exp_avg``, ...)."""
    chunk_states: list[dict[str, Any]] = field(default_factory=list)
    installed: list[dict[str, Any]] | None = None
    """What ``optimizer.state[p]`` held when the run last installed it, per parameter."""

    def __post_init__(self) -> None:
        self.chunks = [self.weights[start:end] for start, end in self.chunk_bounds]

    @property
    def numel(self) -> int:
        return self.weights.numel()

    def weights_in_place(self) -> bool:
        """Whether the parameters still tile the buffer the run was planned on."""
        flat = flat_over([local_tensor(param) for param in self.params])
        return (
            flat is not None
            and flat.untyped_storage() is self.weights.untyped_storage()
            and flat.storage_offset() == self.weights.storage_offset()
            and flat.numel() == self.numel
        )

    def flat_grads(self) -> torch.Tensor | None:
        grads: list[torch.Tensor] = []
        for param in self.params:
            grad = param.grad
            if grad is None:
                return None
            grads.append(local_tensor(grad))
        flat = flat_over(grads)
        if flat is None or flat.numel() != self.numel or flat.dtype != self.weights.dtype:
            return None
        return flat

    def state_is_current(self, state: dict[torch.Tensor, Any]) -> bool:
        if self.installed is None:
            return False
        for param, installed in zip(self.params, self.installed, strict=True):
            held = state.get(param)
            if held is None or len(held) != len(installed):
                return False
            for key, value in installed.items():
                if held.get(key) is not value:
                    return False
        return True

    def adopt(self, state: dict[torch.Tensor, Any]) -> bool:
        """Take over the per-parameter state torch holds; False where it is inconsistent.

        No state at all is consistent: torch then creates it for the chunks at this step.
        """
        entries = [state.get(param) or {} for param in self.params]
        if not any(entries):
            self.flats, self.scalars, self.installed = None, {}, None
            self.chunk_states = [{} for _ in self.chunks]
            return True
        by_key = tensor_entries(entries)
        shapes = [local_tensor(param).shape for param in self.params]
        split = None if by_key is None else split_state(by_key, shapes)
        if split is None:
            return False
        elementwise, scalars = split
        flats: dict[str, torch.Tensor] = {}
        for key, values in elementwise.items():
            flat = flat_over(values)
            if flat is None or flat.numel() != self.numel:
                flat = torch.cat([value.reshape(-1) for value in values])
            flats[key] = flat
        # The run's counter is its own: a loaded one may also be held by parameters of other
        # runs (a state dict pickled from runs cut elsewhere), each of which would count it.
        owned = {key: scalar.clone() for key, scalar in scalars.items()}
        self._hold(flats, owned, tuple(by_key or ()))
        self.install(state)
        return True

    def adopt_created(self, state: dict[torch.Tensor, Any]) -> None:
        """Take over, and install per parameter, the state torch created at the first step."""
        created = [state.get(chunk) or {} for chunk in self.chunks]
        by_key = tensor_entries(created)
        split = None if by_key is None else split_state(by_key, [c.shape for c in self.chunks])
        if split is None:  # the weights were already stepped: losing this state is not an option
            raise RuntimeError(
                f"contiguous_step: {sorted(created[0])} is not elementwise state; "
                "pass contiguous_step=False for this optimizer"
            )
        elementwise, scalars = split
        keys, order = list(elementwise), tuple(by_key or ())
        del by_key, split, elementwise
        flats: dict[str, torch.Tensor] = {}
        for key in keys:
            # Each chunk's tensor is dropped as soon as it is copied, so at most one key of
            # one run is held twice.
            first = created[0][key]
            # Made from the state it replaces: on its side of the host/device line, as a
            # tracker reads it where the CPU stands in for the device (mfsdp_buffers.residence).
            flat = first.new_empty(self.numel)
            del first
            for entry, (start, end) in zip(created, self.chunk_bounds, strict=True):
                flat[start:end].copy_(entry.pop(key))
            flats[key] = flat
        self._hold(flats, scalars, order)
        self.install(state)

    def _ordered(self, views: dict[str, torch.Tensor]) -> dict[str, Any]:
        """A state entry of ``views`` (one per elementwise key) and the shared scalars, in
        torch's key order."""
        return {key: views[key] if key in views else self.scalars[key] for key in self.order}

    def _hold(
        self,
        flats: dict[str, torch.Tensor],
        scalars: dict[str, torch.Tensor],
        order: tuple[str, ...],
    ) -> None:
        self.flats, self.scalars, self.order = flats, scalars, order
        # Chunk 0 holds the shared scalars themselves: torch's in-place update of its step
        # counter is then what every parameter of the run sees. The other chunks hold copies,
        # refreshed before each step.
        self.chunk_states = []
        for index, (start, end) in enumerate(self.chunk_bounds):
            entry = self._ordered({key: flat[start:end] for key, flat in flats.items()})
            if index:
                entry.update((key, scalar.clone()) for key, scalar in scalars.items())
            self.chunk_states.append(entry)

    def refresh_chunk_scalars(self) -> None:
        for entry in self.chunk_states[1:]:
            for key, scalar in self.scalars.items():
                entry[key].copy_(scalar)

    def install(self, state: dict[torch.Tensor, Any]) -> None:
        """Point every parameter's state at views of the run's state."""
        assert self.flats is not None
        installed: list[dict[str, Any]] = []
        with torch.no_grad():
            for param, offset in zip(self.params, self.offsets, strict=True):
                views = {key: view_like(flat, param, offset) for key, flat in self.flats.items()}
                entry = self._ordered(views)
                state[param] = entry
                installed.append(dict(entry))
        self.installed = installed

    def release(self, state: dict[torch.Tensor, Any]) -> None:
        """Hand the run back to torch's per-parameter loop for this step.

        Each parameter gets its own copy of the shared scalars (torch would otherwise count
        one step once per parameter); the elementwise views stay valid as they are.
        """
        if self.state_is_current(state):
            for param in self.params:
                entry = state[param]
                for key, scalar in self.scalars.items():
                    entry[key] = scalar.clone()
        self.flats, self.scalars, self.installed = None, {}, None
        self.chunk_states = []


def _plan_runs(
    params: list[torch.Tensor], eligible: Callable[[torch.Tensor], bool], chunk_numel: int
) -> list[_Run]:
    runs: list[_Run] = []
    members: list[torch.Tensor] = []

    last: torch.Tensor | None = None  # the run's last non-empty piece

    def close() -> None:
        nonlocal last
        flat = flat_over([local_tensor(p) for p in members])
        if flat is not None:
            offsets, cursor = [], 0
            for param in members:
                offsets.append(cursor)
                cursor += local_tensor(param).numel()
            bounds = [
                (start, min(start + chunk_numel, cursor)) for start in range(0, cursor, chunk_numel)
            ]
            runs.append(_Run(list(members), offsets, flat, bounds))
        members.clear()
        last = None

    for param in params:
        local = local_tensor(param)
        if not eligible(param) or local.dim() == 0 or not local.is_floating_point():
            close()
            continue
        if local.numel():
            if last is not None and flat_over([last, local]) is None:
                close()
            last = local
        members.append(param)
    close()
    return runs


@dataclass
class _GroupPlan:
    key: tuple[int, ...]
    runs: list[_Run]


class ContiguousStepper:
    """Swaps an optimizer's parameter lists for flat chunks around one ``step`` call."""

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        eligible: Callable[[torch.Tensor], bool],
        chunk_numel: int | None = None,
    ) -> None:
        if type(optimizer) not in CONTIGUOUS_STEP_OPTIMIZERS:
            names = ", ".join(cls.__name__ for cls in CONTIGUOUS_STEP_OPTIMIZERS)
            raise TypeError(
                f"contiguous_step: {type(optimizer).__name__} is not one of the elementwise "
                f"optimizers it supports ({names}); pass contiguous_step=False"
            )
        if chunk_numel is not None and (isinstance(chunk_numel, bool) or chunk_numel < 1):
            raise ValueError(
                f"step_chunk_numel must be a positive int or None (automatic), got {chunk_numel!r}"
            )
        self.optimizer = optimizer
        self.eligible = eligible
        self.chunk_numel = chunk_numel
        self._plans: list[_GroupPlan] = []
        # Every load, whatever objects it leaves in ``optimizer.state``, makes each run take
        # up the loaded state afresh at its next step.
        optimizer.register_load_state_dict_post_hook(self._after_load)
        optimizer.register_state_dict_post_hook(counters_per_parameter)

    def _after_load(self, optimizer: torch.optim.Optimizer) -> None:
        for plan in self._plans:
            for run in plan.runs:
                run.installed = None

    def _chunk_numel_for(self, params: list[torch.Tensor]) -> int:
        if self.chunk_numel is not None:
            return self.chunk_numel
        on_cpu = all(local_tensor(p).device.type == "cpu" for p in params)
        return CPU_CHUNK_NUMEL if on_cpu else ACCELERATOR_CHUNK_NUMEL

    def _plan(self, index: int, group: dict[str, Any]) -> _GroupPlan:
        params: list[torch.Tensor] = group["params"]
        key = tuple(id(p) for p in params)
        while len(self._plans) <= index:
            self._plans.append(_GroupPlan((), []))
        plan = self._plans[index]
        if plan.key != key or not all(run.weights_in_place() for run in plan.runs):
            runs = _plan_runs(params, self.eligible, self._chunk_numel_for(params))
            plan = self._plans[index] = _GroupPlan(key, runs)
        return plan

    def hand_back(self) -> None:
        """Let torch's own loop step every parameter next (a closure re-creates gradients)."""
        for plan in self._plans:
            for run in plan.runs:
                run.release(self.optimizer.state)

    @contextmanager
    def stepping(self) -> Iterator[None]:
        """Inside, each group lists flat chunks with gradients in place of the runs it covers."""
        optimizer = self.optimizer
        state: dict[torch.Tensor, Any] = optimizer.state
        originals: list[list[torch.Tensor]] = []
        stepped: list[_Run] = []
        try:
            for index, group in enumerate(optimizer.param_groups):
                originals.append(group["params"])
                # A fused kernel already makes one call per group, and its vector and tail
                # paths round differently, so re-chunking would change its results.
                if group.get("differentiable", False) or group.get("fused", False):
                    continue
                covered: set[int] = set()
                swapped: list[torch.Tensor] = []
                for run in self._plan(index, group).runs:
                    grads = run.flat_grads()
                    ready = grads is not None and (run.state_is_current(state) or run.adopt(state))
                    if not ready:
                        run.release(state)
                        continue
                    assert grads is not None
                    run.refresh_chunk_scalars()
                    for chunk, chunk_state, (start, end) in zip(
                        run.chunks, run.chunk_states, run.chunk_bounds, strict=True
                    ):
                        chunk.grad = grads[start:end]
                        if chunk_state:
                            state[chunk] = chunk_state
                    covered.update(id(p) for p in run.params)
                    swapped.extend(run.chunks)
                    stepped.append(run)
                if covered:
                    rest = [p for p in group["params"] if id(p) not in covered]
                    group["params"] = swapped + rest
            yield
            for run in stepped:
                if run.flats is None:
                    run.adopt_created(state)
        finally:
            for group, params in zip(optimizer.param_groups, originals, strict=False):
                group["params"] = params
            for run in stepped:
                for chunk in run.chunks:
                    chunk.grad = None
                    state.pop(chunk, None)


__all__ = [
    "ACCELERATOR_CHUNK_NUMEL",
    "CPU_CHUNK_NUMEL",
    "CONTIGUOUS_STEP_OPTIMIZERS",
    "ContiguousStepper",
]
