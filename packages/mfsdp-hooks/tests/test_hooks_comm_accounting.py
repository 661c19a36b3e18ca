"""Exact collectives of one ZeRO-3 step, and zero-copy unsharding."""

from __future__ import annotations

import torch
from hooks_models import Block, loss_fn, make_batches, make_model
from torch.utils._python_dispatch import TorchDispatchMode

from mfsdp_collectives import CommTracer
from mfsdp_collectives.testing import run_distributed
from mfsdp_hooks import fsdp_units, fully_shard
from mfsdp_hooks.testing.parity import shard_blocks


def _expected_traffic(model: torch.nn.Module) -> dict[str, tuple[int, int]]:
    """(calls, bytes) per op that follow from the layouts of every unit's groups."""
    units = fsdp_units(model)
    root = next(u for u in units if u.module is model)
    forward = [g for u in units for g in u.groups]
    backward = [g for u in units if u is not root for g in u.groups]
    reduced = [g for u in units for g in u.groups if g.requires_grad]
    gathers = forward + backward
    return {
        "all_gather": (
            len(gathers),
            sum(g.layout.shard_numel * g.compute_dtype.itemsize for g in gathers),
        ),
        "reduce_scatter": (
            len(reduced),
            sum(g.layout.padded_numel * g.reduce_dtype.itemsize for g in reduced),
        ),
        # which parameters got a gradient on some rank (grads/grad_presence): one fp32 flag
        # per parameter, one call per synced backward
        "grad_presence": (1, 4 * sum(len(g.layout.placements) for g in reduced)),
    }


def _accounting_worker(rank: int, world: int) -> dict[str, tuple[int, int]]:
    model = make_model()
    shard_blocks(model)
    tokens, targets = make_batches(1, 4)[0]
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    for _ in range(2):  # the second step runs with the recorded order and prefetching
        with CommTracer() as tracer:
            loss_fn(model(tokens), targets).backward()
        optimizer.step()
        optimizer.zero_grad()
    expected = _expected_traffic(model)
    got = {op: (tracer.calls(op), tracer.bytes(op)) for op in expected}
    assert got == expected, (got, expected)
    assert tracer.calls("all_reduce") == 0
    return got


def test_zero3_step_moves_exactly_the_layout_bytes() -> None:
    results = run_distributed(_accounting_worker, 2, timeout=60)
    # 3 blocks + root (trainable and frozen groups): 5 gathers forward, 3 backward; 4 reductions
    assert [r["all_gather"][0] for r in results] == [8, 8]
    assert [r["reduce_scatter"][0] for r in results] == [4, 4]


class _CountCopies(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.copies = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        if func.overloadpacket in (torch.ops.aten.copy_, torch.ops.aten._to_copy):
            self.copies += 1
        return func(*args, **(kwargs or {}))


def _zero_copy_worker(rank: int, world: int) -> int:
    model = make_model()
    fully_shard(model.blocks[0])
    unit = fsdp_units(model.blocks[0])[0]
    group = unit.groups[0]
    with _CountCopies() as counter:
        unit.unshard()
    base = group.model.unsharded
    assert base is not None
    storage = base.untyped_storage().data_ptr()
    block = model.blocks[0]
    assert isinstance(block, Block)
    for param in (block.fc1.weight, block.fc2.weight, block.norm.bias):
        assert param.untyped_storage().data_ptr() == storage, "parameter is not a buffer view"
    unit.reshard()
    assert base.untyped_storage().nbytes() == 0, "unsharded storage was not freed"
    return counter.copies


def test_unshard_hands_out_views_and_copies_nothing() -> None:
    assert run_distributed(_zero_copy_worker, 2, timeout=60) == [0, 0]


def _prefetch_worker(rank: int, world: int, overlap: bool, depth: int = 1) -> list[int]:
    model = make_model()
    shard_blocks(model, overlap_param_gather=overlap, prefetch_depth=depth)
    tokens, targets = make_batches(1, 4)[0]
    seen: list[int] = []
    tracer = CommTracer()

    def note_gathers(module: torch.nn.Module, args: object) -> None:
        seen.append(tracer.calls("all_gather"))

    model.blocks[0].register_forward_pre_hook(note_gathers)
    for _ in range(2):  # the first iteration records the order, the second prefetches
        seen.clear()
        with tracer:
            tracer.reset()
            loss_fn(model(tokens), targets).backward()
    return seen


def test_next_unit_is_gathered_while_the_current_one_computes() -> None:
    # When block 0 starts computing: root (2 groups) + block 0 are gathered, and with overlap
    # the all-gather of block 1 has already been issued.
    assert run_distributed(_prefetch_worker, 2, True, timeout=60) == [[4], [4]]
    assert run_distributed(_prefetch_worker, 2, False, timeout=60) == [[3], [3]]
    # prefetch_depth=2: blocks 1 and 2 are both in flight when block 0 starts.
    assert run_distributed(_prefetch_worker, 2, True, 2, timeout=60) == [[5], [5]]


def _trace_pool_worker(rank: int, world: int) -> tuple[str, int, int, int]:
    from mfsdp_buffers import TracePoolAllocator
    from mfsdp_hooks import FSDPRootWrapper, ShardingOptions

    options = ShardingOptions(grad_buffer_allocator="trace_pool", sync_model_each_microbatch=False)
    model = FSDPRootWrapper(make_model(), fsdp_unit_modules=[Block], options=options)
    allocator = fsdp_units(model.module)[0].options.grad_allocator
    assert isinstance(allocator, TracePoolAllocator)
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    tokens, targets = make_batches(1, 4)[0]
    for step in range(4):
        loss_fn(model(tokens), targets).backward()
        model.finish_grad_sync()
        optimizer.step()
        optimizer.zero_grad()
        if step == 1:
            with torch.no_grad():  # a forward-only pass between training steps
                model(tokens)
    dtype = torch.float32
    return (
        allocator.phase.name,
        allocator.fallbacks,
        allocator.pool_numel(dtype, torch.device("cpu")),
        allocator.naive_numel,
    )


def test_trace_pool_replays_gradient_buffers_from_a_smaller_pool() -> None:
    for phase, fallbacks, pool, naive in run_distributed(_trace_pool_worker, 2, timeout=60):
        assert phase == "REPLAY"
        assert fallbacks == 0
        assert 0 < pool < naive


def _explicit_prefetch_worker(rank: int, world: int) -> list[bool]:
    model = make_model()
    shard_blocks(model)
    blocks = list(model.blocks)
    blocks[0].set_modules_to_forward_prefetch([blocks[2]])  # type: ignore[operator]
    units = [fsdp_units(b)[0] for b in blocks]
    seen: list[bool] = []

    def note(module: torch.nn.Module, args: object) -> None:
        seen.extend([units[1].is_unsharded, units[2].is_unsharded])

    blocks[0].register_forward_pre_hook(note)
    tokens, targets = make_batches(1, 4)[0]
    loss_fn(model(tokens), targets).backward()
    handle = blocks[1].unshard(async_op=True)  # type: ignore[operator]
    handle.wait()
    seen.append(units[1].is_unsharded)
    blocks[1].reshard()  # type: ignore[operator]
    seen.append(units[1].is_unsharded)
    return seen


def test_explicit_prefetch_list_and_manual_unshard() -> None:
    # Block 0 prefetches block 2 (not block 1) even on the first iteration.
    assert (
        run_distributed(_explicit_prefetch_worker, 2, timeout=60)
        == [[False, True, True, False]] * 2
    )


def _per_unit_trace_pools_worker(rank: int, world: int) -> list[str]:
    from mfsdp_buffers import TracePoolAllocator

    model = make_model()
    shard_blocks(model, grad_buffer_allocator="trace_pool")
    tokens, targets = make_batches(1, 4)[0]
    for _ in range(3):
        loss_fn(model(tokens), targets).backward()
    phases = []
    for unit in fsdp_units(model):
        allocator = unit.options.grad_allocator
        assert isinstance(allocator, TracePoolAllocator)
        phases.append(allocator.phase.name)
    return phases


def test_every_units_own_trace_pool_is_told_when_an_iteration_ends() -> None:
    # Per-module calls give each unit its own pool; the root must end the iteration of all.
    assert run_distributed(_per_unit_trace_pools_worker, 2, timeout=60) == [["REPLAY"] * 4] * 2
