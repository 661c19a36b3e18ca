"""The timeline recorder (``record_timeline``) on real 2-rank gloo worlds and on its own.

What is checked against something other than the recorder: the all-gathers and reductions
it records are the collectives ``CommTracer`` counted; the training losses are bit for bit
those of the same run untraced. What is checked of the recorder's own bookkeeping: each
span's self time is its duration less that of the spans directly inside it, and the step's
shares add up to its wall time exactly.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from mfsdp_collectives import CommTracer
from mfsdp_collectives.testing import run_distributed
from mfsdp_hooks import (
    EventKind,
    TimelineEvent,
    TimelineStep,
    attach_optimizer,
    fsdp_units,
    fully_shard,
    record_timeline,
)
from mfsdp_hooks.runtime import timeline
from mfsdp_hooks.testing.parity import shard_blocks

STEPS = 3
SPANS = {kind for kind in EventKind if kind.category is not None}


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(12, 20)
        self.down = nn.Linear(20, 12)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = x + self.down(torch.relu(self.up(x)))
        return out


def _sharded(strategy: int) -> nn.Sequential:
    """A root with parameters of its own around two block units: one group per unit."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 12), Block(), Block(), nn.Linear(12, 3))
    for block in (model[1], model[2]):
        fully_shard(block, sharding_strategy=strategy)
    fully_shard(model, sharding_strategy=strategy)
    return model


def _train(
    model: nn.Module, optimizer: torch.optim.Optimizer, rank: int, steps: int = STEPS
) -> tuple[list[float], list[dict[str, int]]]:
    """Losses, and each step's collectives as ``CommTracer`` counted them."""
    batch = torch.randn(4, 6, generator=torch.Generator().manual_seed(10 + rank))
    losses, calls = [], []
    for _ in range(steps):
        with CommTracer() as tracer:
            loss = model(batch).pow(2).mean()
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
        losses.append(loss.item())
        calls.append({op: tracer.calls(op) for op in ("all_gather", "reduce_scatter")})
    return losses, calls


def _direct_children(spans: list[TimelineEvent]) -> dict[int, list[TimelineEvent]]:
    """Each span's spans directly inside it, by interval containment (they nest)."""
    children: dict[int, list[TimelineEvent]] = {id(span): [] for span in spans}
    open_spans: list[TimelineEvent] = []
    for span in sorted(spans, key=lambda s: (s.start_ns, -s.end_ns)):
        while open_spans and open_spans[-1].end_ns <= span.start_ns:
            open_spans.pop()
        if open_spans:
            assert span.end_ns <= open_spans[-1].end_ns, ("spans cross", span, open_spans[-1])
            children[id(open_spans[-1])].append(span)
        open_spans.append(span)
    return children


def _check_step(step: TimelineStep, units: list[str]) -> None:
    """Self times, the partition, and issue-before-ready of every gather and reduction."""
    assert sum(step.host_time().values()) == step.duration_ns
    spans = [e for e in step.events if e.kind in SPANS]
    children = _direct_children(spans)
    for span in spans:
        assert step.start_ns <= span.start_ns <= span.end_ns <= step.end_ns
        inner = sum(c.duration_ns for c in children[id(span)])
        assert span.self_ns == span.duration_ns - inner, span
    for unit in units:
        assert len(step.of_kind(EventKind.FORWARD, unit)) == 1, (unit, step.index)
        assert len(step.of_kind(EventKind.BACKWARD, unit)) == 1, (unit, step.index)
        for flight, issue, wait in (
            (EventKind.ALL_GATHER, EventKind.ALL_GATHER_ISSUE, EventKind.ALL_GATHER_WAIT),
            (EventKind.REDUCE, EventKind.REDUCE_ISSUE, EventKind.REDUCE_WAIT),
        ):
            for event in step.of_kind(flight, unit):
                assert event.start_ns < event.end_ns
                assert event.start_ns in {e.start_ns for e in step.of_kind(issue, unit)}
                assert event.end_ns in {e.end_ns for e in step.of_kind(wait, unit)}


def _zero3_worker(rank: int, world: int) -> dict[str, Any]:
    untraced = _sharded(3)
    plain_losses, _ = _train(untraced, torch.optim.AdamW(untraced.parameters()), rank)
    model = _sharded(3)
    optimizer = torch.optim.AdamW(model.parameters())
    with record_timeline(fsdp_units(model), optimizer) as recorder:
        losses, calls = _train(model, optimizer, rank)
        assert timeline.ACTIVE is recorder
    steps = list(recorder.steps)
    units = recorder.unit_labels()
    hooks_left = len(optimizer._optimizer_step_pre_hooks) + len(
        optimizer._optimizer_step_post_hooks
    )
    _train(model, optimizer, rank, steps=1)  # after the block: nothing more is recorded
    for step in steps:
        _check_step(step, units)
    root, blocks = units[0], units[1:]
    for step in steps:
        (root_forward,) = step.of_kind(EventKind.FORWARD, root)
        for block in blocks:  # nested units: the blocks run inside the root's forward ...
            (forward,) = step.of_kind(EventKind.FORWARD, block)
            assert root_forward.start_ns < forward.start_ns < forward.end_ns < root_forward.end_ns
        # ... and their time is theirs, not the root's too
        inside = sum(e.duration_ns for b in blocks for e in step.of_kind(EventKind.FORWARD, b))
        assert root_forward.self_ns <= root_forward.duration_ns - inside
    return {
        "same_losses": losses == plain_losses,
        "gathers": [len(s.of_kind(EventKind.ALL_GATHER)) for s in steps],
        "reductions": [len(s.of_kind(EventKind.REDUCE)) for s in steps],
        "reductions_per_unit": [
            [len(s.of_kind(EventKind.REDUCE, u)) for u in units] for s in steps
        ],
        "calls": calls,
        "steps": len(steps),
        "optimizer_spans": [len(s.of_kind(EventKind.OPTIMIZER)) for s in steps],
        "after": (len(recorder.steps), recorder.steps == steps, timeline.ACTIVE is None),
        "hooks_left": hooks_left,
    }


def test_zero3_timeline_counts_what_the_collectives_did() -> None:
    for result in run_distributed(_zero3_worker, 2, timeout=120):
        assert result["same_losses"]
        assert result["steps"] == STEPS
        # Forward gathers every unit; backward gathers the two blocks again (the root keeps
        # its weights from forward to backward): each one collective, as CommTracer saw.
        assert result["gathers"] == [5] * STEPS
        assert result["gathers"] == [c["all_gather"] for c in result["calls"]]
        assert result["reductions"] == [c["reduce_scatter"] for c in result["calls"]]
        assert result["reductions_per_unit"] == [[1, 1, 1]] * STEPS
        assert result["optimizer_spans"] == [1] * STEPS
        assert result["after"] == (STEPS, True, True)
        assert result["hooks_left"] == 0


def _zero1_worker(rank: int, world: int, attached: bool) -> list[tuple[int, int, int]]:
    model = _sharded(1)
    optimizer = torch.optim.AdamW(model.parameters())
    if attached:
        attach_optimizer(optimizer)
    with record_timeline(fsdp_units(model), optimizer) as recorder:
        _, calls = _train(model, optimizer, rank)
    units = recorder.unit_labels()
    counts = []
    for step, call in zip(recorder.steps, calls, strict=True):
        _check_step(step, units)
        backward_gathers = [
            e
            for b in step.of_kind(EventKind.BACKWARD)
            for e in step.of_kind(EventKind.ALL_GATHER_ISSUE)
            if b.start_ns <= e.start_ns <= b.end_ns
        ]
        recorded = len(step.of_kind(EventKind.ALL_GATHER))
        counts.append((recorded, call["all_gather"], len(backward_gathers)))
    return counts


@pytest.mark.parametrize("attached", [False, True])
def test_zero1_gathers_weights_only_to_install_a_step(attached: bool) -> None:
    """ZeRO-1 keeps whole weights: nothing is gathered for forward or backward. A bare
    optimizer leaves the next forward to install its update (one gather per unit, the
    first step has none); an attached one installs inside its step, timed as the
    optimizer's, so no unit gathers at all."""
    for counts in run_distributed(_zero1_worker, 2, attached, timeout=120):
        for step, (recorded, collectives, in_backward) in enumerate(counts):
            assert in_backward == 0
            if attached:
                assert recorded == 0
            else:
                assert recorded == collectives == (0 if step == 0 else 3)


def _traced_two_steps(model: torch.nn.Module, device: torch.device) -> Any:
    """Shard ``model``'s blocks and root per module, train two SGD steps under a timeline."""
    from mfsdp_hooks.testing import loss_fn, make_batches

    shard_blocks(model)
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    with record_timeline(fsdp_units(model), optimizer) as recorder:
        for tokens, targets in make_batches(2, global_batch=4):
            loss = loss_fn(model(tokens.to(device)), targets.to(device))
            loss.backward()  # type: ignore[no-untyped-call]
            optimizer.step()
            optimizer.zero_grad()
    return recorder


def _recompute_worker(rank: int, world: int) -> list[tuple[int, int, int]]:
    from mfsdp_hooks.testing import Block as ToyBlock
    from mfsdp_hooks.testing import make_model

    model = make_model(n_blocks=2, checkpoint="non_reentrant")
    recorder = _traced_two_steps(model, torch.device("cpu"))
    units = recorder.unit_labels()
    blocks = [u for u in units if f"({ToyBlock.__name__})" in u]
    found = []
    for step in recorder.steps:
        _check_step(step, units)
        recomputes = [e for b in blocks for e in step.of_kind(EventKind.RECOMPUTE, b)]
        inside = [  # each recompute runs inside its own unit's backward
            r
            for r in recomputes
            for b in step.of_kind(EventKind.BACKWARD, r.unit)
            if b.start_ns <= r.start_ns and r.end_ns <= b.end_ns
        ]
        found.append((len(recomputes), len(inside), len(step.of_kind(EventKind.ALL_GATHER))))
    return found


def test_activation_recompute_is_backward_time_and_gathers_nothing_more() -> None:
    for found in run_distributed(_recompute_worker, 2, timeout=120):
        # Two blocks recomputed in each step's backward; gathers as without recompute: the
        # root and two blocks forward, the two blocks again backward.
        assert found == [(2, 2, 5), (2, 2, 5)]


# ----------------------------------------------------------------- the recorder alone


class _Unit:
    """What the recorder reads of a unit: its name and groups (none: no reductions)."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.groups: list[Any] = []


def test_an_outer_span_ending_first_closes_the_inner_ones_and_the_partition_holds() -> None:
    """The root's final callback may end the root's backward before an inner unit's (a unit
    whose inputs need no gradient ends there too): the inner span ends with it."""
    root: Any = _Unit("Root")
    inner: Any = _Unit("Inner")
    with record_timeline([root, inner]) as recorder:
        recorder.forward_begins(root, root=True, recompute=False)
        recorder.forward_ends(root)
        recorder.backward_begins(root)
        recorder.backward_begins(inner)
        issue = recorder.gather_issue(inner, None)
        assert issue is not None
        issue.end(keep=False)  # issued nothing: its time is the inner backward's
        recorder.backward_ends(root)
        recorder.backward_ends(inner)  # already closed: no-op
    (step,) = recorder.steps
    kinds = [(e.kind, e.unit) for e in step.events]
    assert kinds == [
        (EventKind.FORWARD, "Root"),
        (EventKind.BACKWARD, "Inner"),
        (EventKind.BACKWARD, "Root"),
    ]
    inner_backward, root_backward = step.events[1], step.events[2]
    assert inner_backward.end_ns == root_backward.end_ns
    assert root_backward.self_ns == root_backward.duration_ns - inner_backward.duration_ns
    assert inner_backward.self_ns == inner_backward.duration_ns
    assert sum(step.host_time().values()) == step.duration_ns


def test_nothing_is_recorded_outside_a_step_or_for_other_units() -> None:
    root: Any = _Unit("Root")
    stranger: Any = _Unit("Stranger")
    with record_timeline([root]) as recorder:
        assert recorder.gather_issue(root, None) is None
        recorder.backward_begins(root)
        recorder.forward_begins(stranger, root=True, recompute=False)
    assert recorder.steps == []


def test_a_second_trace_or_no_units_is_refused_and_hooks_go_away_on_error() -> None:
    unit: Any = _Unit("Root")
    optimizer = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=0.1)
    with pytest.raises(ValueError, match="units"), record_timeline([]):
        pass
    with pytest.raises(KeyError), record_timeline([unit], optimizer):
        with pytest.raises(RuntimeError, match="one at a time"), record_timeline([unit]):
            pass
        raise KeyError("the training loop failed")
    assert timeline.ACTIVE is None
    assert not optimizer._optimizer_step_pre_hooks
    assert not optimizer._optimizer_step_post_hooks


def _untraced_worker(rank: int, world: int) -> int:
    """Tracing off: not one span object is built, at any instrumentation point."""
    built = 0
    original = timeline._Span.__init__

    def counting(self: Any, *args: Any) -> None:
        nonlocal built
        built += 1
        original(self, *args)

    timeline._Span.__init__ = counting  # type: ignore[method-assign,assignment]
    model = _sharded(3)
    _train(model, torch.optim.AdamW(model.parameters()), rank, steps=2)
    return built


def test_tracing_off_builds_nothing() -> None:
    assert run_distributed(_untraced_worker, 2, timeout=120) == [0, 0]


def _cuda_worker(rank: int, world: int) -> tuple[int, int, bool]:
    from mfsdp_hooks.testing import make_model

    device = torch.device("cuda", torch.cuda.current_device())
    model = make_model(n_blocks=2).to(device)
    recorder = _traced_two_steps(model, device)
    issues = [
        e
        for s in recorder.steps
        for e in s.events
        if e.kind in (EventKind.ALL_GATHER_ISSUE, EventKind.REDUCE_ISSUE)
    ]
    device_events = [
        e
        for s in recorder.steps
        for e in s.events
        if e.kind in (EventKind.ALL_GATHER_DEVICE, EventKind.REDUCE_DEVICE)
    ]
    ordered = all(e.start_ns <= e.end_ns for e in device_events)
    return len(issues), len(device_events), ordered


@pytest.mark.cuda
def test_cuda_side_streams_add_device_intervals() -> None:
    """Each collective issued on CUDA side streams gets its device interval (events on the
    compute stream before the issue and on the side stream after it)."""
    if not torch.cuda.is_available() or not torch.distributed.is_nccl_available():
        pytest.skip("needs a CUDA device and NCCL: side streams only exist there")
    ((issues, device_events, ordered),) = run_distributed(_cuda_worker, 1, backend="nccl")
    assert issues > 0 and device_events == issues and ordered
