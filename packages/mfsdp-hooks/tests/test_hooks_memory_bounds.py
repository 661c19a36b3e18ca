"""Live tensor bytes stay under analytic bounds through every phase of a training step.

The bounds are written in the sizes the layouts give (sharded and unsharded bytes of each
unit) plus the activations of the same local batch, measured on an unsharded copy of the
model. A regression that keeps an unsharded buffer alive, leaks the original parameters or
materialises gradients for the whole model at once exceeds them.
"""

from __future__ import annotations

import gc
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any
from unittest import mock

import pytest
import torch
from torch import nn

from mfsdp_buffers import LiveTensorTracker, PlainAllocator
from mfsdp_collectives.testing import run_distributed
from mfsdp_hooks import (
    FSDPRootWrapper,
    ParameterGroup,
    ShardingOptions,
    attach_optimizer,
    fsdp_units,
)
from mfsdp_hooks.runtime.unit import FSDPUnit

WIDTH, BLOCKS, BATCH = 128, 6, 4
SLACK = 64 * 1024  # scalars, loss, small temporaries


class MemBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(WIDTH, 2 * WIDTH)
        self.down = nn.Linear(2 * WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(x)))


class MemModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(WIDTH, WIDTH)
        self.blocks = nn.Sequential(*(MemBlock() for _ in range(BLOCKS)))
        self.out = nn.Linear(WIDTH, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.blocks(self.inp(x)))


@dataclass
class Sizes:
    """Bytes that follow from the layouts of the wrapped model."""

    sharded_weights: int  # persistent model/main weights the optimizer steps on
    full_weights: int  # persistent whole model buffers (strategies 0-2)
    grad_shards: int  # reduced gradients, alive from backward until zero_grad
    root_unsharded: int
    root_grad: int  # the root's reduce buffer fills over the whole backward
    max_unit_unsharded: int
    max_unit_grad: int
    max_param_grad: int  # a gradient autograd hands over before it is copied in


def _weight_bytes(group: ParameterGroup) -> tuple[int, int]:
    sharded = full = 0
    optimizer_buffer = group.main if group.main is not None else group.model
    sharded += optimizer_buffer.layout.shard_numel * optimizer_buffer.dtype.itemsize
    if not group.model.sharded:
        full += group.layout.padded_numel * group.model.dtype.itemsize
        if group.main is None:
            sharded = 0  # the optimizer steps on a slice of the whole buffer
    return sharded, full


def _sizes(model: nn.Module) -> Sizes:
    units = fsdp_units(model)
    root = next(u for u in units if u.module is model)
    sharded = full = grads = 0
    for unit in units:
        for group in unit.groups:
            s, f = _weight_bytes(group)
            sharded += s
            full += f
            if group.grads is not None:
                grads += group.grads.numel * group.grads.dtype.itemsize

    def unsharded(unit: FSDPUnit) -> int:
        return sum(g.layout.padded_numel * g.compute_dtype.itemsize for g in unit.groups)

    def grad_buffer(unit: FSDPUnit) -> int:
        return sum(
            g.layout.padded_numel * g.reduce_dtype.itemsize for g in unit.groups if g.requires_grad
        )

    return Sizes(
        sharded_weights=sharded,
        full_weights=full,
        grad_shards=grads,
        root_unsharded=unsharded(root) if root.options.strategy.shards_params else 0,
        root_grad=grad_buffer(root),
        max_unit_unsharded=max(unsharded(u) for u in units),
        max_unit_grad=max(grad_buffer(u) for u in units),
        max_param_grad=max(p.numel() * 4 for p in model.parameters()),
    )


def _activation_bytes(batch: torch.Tensor) -> int:
    """Live bytes a forward of the unsharded model on ``batch`` leaves for backward."""
    with LiveTensorTracker() as tracker:
        torch.manual_seed(0)
        model = MemModel()
        before = tracker.live
        loss = model(batch).pow(2).mean()
        saved = tracker.live - before
    del loss, model
    return saved


def sizes_at_wrap_time(model: FSDPRootWrapper) -> int:
    """Weights plus reduced gradients: what must be live once a backward has finished."""
    sizes = _sizes(model.module)
    return sizes.sharded_weights + sizes.full_weights + sizes.grad_shards + SLACK


def _settle(tracker: LiveTensorTracker, bound: int, timeout: float = 5.0) -> None:
    """Give gloo's worker threads time to drop the inputs of reductions that already finished.

    ``wait()`` returns when a collective is complete, but the backend releases its references
    to the tensors a moment later on its own thread. Poll (bounded) until the live bytes fall
    to ``bound``; a real leak never does, and the assertion after this reports it.
    """
    deadline = time.monotonic() + timeout
    while tracker.live > bound and time.monotonic() < deadline:
        gc.collect()
        time.sleep(0.01)


def _memory_worker(
    rank: int, world: int, strategy: int, optimizer_mode: str
) -> dict[str, tuple[int, int]]:
    batch = torch.randn(BATCH, WIDTH, generator=torch.Generator().manual_seed(rank))
    activations = _activation_bytes(batch)
    with LiveTensorTracker() as tracker:
        torch.manual_seed(0)
        options = ShardingOptions(zero_dp_strategy=strategy, sync_model_each_microbatch=False)
        model = FSDPRootWrapper(MemModel(), fsdp_unit_modules=[MemBlock], options=options)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=False)
        if optimizer_mode == "contiguous":
            attach_optimizer(optimizer)
        init = tracker.mark("init")
        loss = model(batch).pow(2).mean()
        forward = tracker.mark("forward")
        loss.backward()
        model.finish_grad_sync()
        del loss
        _settle(tracker, sizes_at_wrap_time(model))
        backward = tracker.mark("backward")
        optimizer.step()
        step = tracker.mark("step")
        optimizer.zero_grad()
        zero = tracker.mark("zero_grad")

    sizes = _sizes(model.module)
    weights = sizes.sharded_weights + sizes.full_weights
    grads = sizes.grad_shards
    optimizer_state = 2 * sizes.sharded_weights if sizes.sharded_weights else 2 * sizes.full_weights
    gathered = 2 * sizes.max_unit_unsharded if strategy == 3 else 0  # current + prefetched
    # The reductions allowed in flight + one unit filling, the root's buffer, and the
    # gradients autograd holds around one AccumulateGrad (incoming, its copy, the next one's).
    in_flight = fsdp_units(model.module)[0].options.root.max_inflight_reductions
    in_flight_grads = (
        (in_flight + 1) * sizes.max_unit_grad + sizes.root_grad + 3 * sizes.max_param_grad
    )
    bounds = {
        # No gradient memory before the first backward, none after zero_grad(set_to_none).
        "init": (init.live, weights + SLACK),
        "forward": (forward.live, weights + sizes.root_unsharded + activations + SLACK),
        "forward_peak": (
            forward.peak,
            weights + sizes.root_unsharded + gathered + activations + SLACK,
        ),
        "backward": (backward.live, weights + grads + SLACK),
        "backward_peak": (
            backward.peak,
            weights
            + grads
            + sizes.root_unsharded
            + gathered
            + activations
            + in_flight_grads
            + SLACK,
        ),
        "step": (step.live, weights + grads + optimizer_state + SLACK),
        # The first step creates the state. On top: the optimizer's temporaries (a parameter's
        # or a chunk's) and, for the contiguous step, one run's state key while it is
        # gathered into the run's flat buffer; a unit's gradient bytes bound each.
        "step_peak": (step.peak, weights + grads + optimizer_state + 4 * sizes.max_unit_grad),
        "zero_grad": (zero.live, weights + optimizer_state + SLACK),
    }
    for phase, (live, bound) in bounds.items():
        assert live <= bound, f"strategy {strategy} world {world}: {phase} {live} > bound {bound}"
    return bounds


@pytest.mark.parametrize("optimizer_mode", ["torch", "contiguous"])
@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("strategy", [1, 2, 3])
def test_live_bytes_stay_under_the_layout_bounds(
    strategy: int, world: int, optimizer_mode: str
) -> None:
    results = run_distributed(_memory_worker, world, strategy, optimizer_mode, timeout=120)
    for bounds in results:
        init_live, _ = bounds["init"]
        full_model = sum(p.numel() * 4 for p in MemModel().parameters())
        if strategy == 3:
            # Sharding must actually save memory: weights + grads well under one full model.
            assert init_live < full_model * (2 / world + 0.25)


class WideBlock(nn.Module):
    """A block whose backward activations are much wider than its weights."""

    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(32, 256)
        self.down = nn.Linear(256, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(x)))


def _steady_backward_peak(
    model: FSDPRootWrapper,
    batch: torch.Tensor,
    tracker: LiveTensorTracker,
    before_backward: Callable[[], object] = lambda: None,
) -> tuple[int, list[float]]:
    """Peak live bytes of the second backward (the first records the prefetch order)."""
    losses, peak = [], 0
    for _ in range(2):
        loss = model(batch).pow(2).mean()
        before_backward()
        tracker.reset_phase()
        loss.backward()
        model.finish_grad_sync()
        losses.append(loss.item())
        peak = tracker.mark("backward").peak
        model.zero_grad(set_to_none=True)
    return peak, losses


def _backward_peak(fraction: float, batch: torch.Tensor) -> tuple[int, int, list[float]]:
    """Peak live bytes of a steady-state backward and one unit's unsharded bytes."""
    torch.manual_seed(0)
    model = FSDPRootWrapper(
        nn.Sequential(*(WideBlock() for _ in range(4))),
        fsdp_unit_modules=[WideBlock],
        options=ShardingOptions(
            backward_prefetch_grad_fraction=fraction, sync_model_each_microbatch=False
        ),
    )
    with LiveTensorTracker() as tracker:
        peak, losses = _steady_backward_peak(model, batch, tracker)
    unit = fsdp_units(model.module)[1]
    unsharded = sum(g.layout.padded_numel * g.compute_dtype.itemsize for g in unit.groups)
    return peak, unsharded, losses


def _late_prefetch_worker(rank: int, world: int) -> tuple[int, int, int]:
    batch = torch.randn(1024, 32, generator=torch.Generator().manual_seed(rank))
    early, unsharded, early_losses = _backward_peak(0.0, batch)
    late, _, late_losses = _backward_peak(0.5, batch)
    assert early_losses == late_losses
    return early, late, unsharded


def test_late_backward_prefetch_keeps_the_next_unit_out_of_the_backward_peak() -> None:
    """With 0.5 the next unit is gathered after this unit's wide activations died; with 0.0
    (FSDP2's timing) its weights are live alongside them."""
    for early, late, unsharded in run_distributed(_late_prefetch_worker, 2, timeout=120):
        assert early - late >= unsharded * 0.9, (early, late, unsharded)


def _reduce_buffer_bytes(transport: str) -> tuple[int, int, int, list[float]]:
    """Bytes of flat reduce buffers requested by one steady-state backward, one unit's
    unsharded bytes, and the backward's peak live bytes."""
    batch = torch.randn(BATCH, WIDTH, generator=torch.Generator().manual_seed(0))
    requested = [0]
    plain_allocate = PlainAllocator.allocate

    def counting(self: PlainAllocator, key: object, numel: int, *args: Any) -> torch.Tensor:
        requested[0] += numel * 4
        return plain_allocate(self, key, numel, *args)

    with LiveTensorTracker() as tracker, mock.patch.object(PlainAllocator, "allocate", counting):
        torch.manual_seed(0)
        options = ShardingOptions(host_transport=transport, sync_model_each_microbatch=False)
        model = FSDPRootWrapper(MemModel(), fsdp_unit_modules=[MemBlock], options=options)
        peak, losses = _steady_backward_peak(
            model, batch, tracker, before_backward=lambda: requested.__setitem__(0, 0)
        )
    unit = fsdp_units(model.module)[1]
    return requested[0], sum(g.layout.padded_numel * 4 for g in unit.groups), peak, losses


def _reduce_buffer_worker(rank: int, world: int) -> list[int]:
    # gloo first: once a group carries the shared-memory transport it keeps it
    gloo_flat, _, gloo_peak, gloo_losses = _reduce_buffer_bytes("gloo")
    shm_flat, unit_bytes, shm_peak, shm_losses = _reduce_buffer_bytes("shm")
    assert shm_losses == gloo_losses
    return [shm_flat, gloo_flat, unit_bytes, shm_peak, gloo_peak]


def test_shared_memory_reduce_scatter_reads_the_gradients_in_place() -> None:
    """Through gloo each unit's gradients are copied into a flat reduce buffer; the
    shared-memory transport reads autograd's gradients where they are."""
    results = run_distributed(_reduce_buffer_worker, 2, timeout=120)
    for shm_flat, gloo_flat, unit_bytes, shm_peak, gloo_peak in results:
        assert shm_flat == 0
        assert gloo_flat >= len(list(MemModel().blocks)) * unit_bytes
        assert shm_peak <= gloo_peak
