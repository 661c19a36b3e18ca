"""PlainAllocator, StorageResizeAllocator and FixedPoolAllocator."""

from __future__ import annotations

import pytest
import torch

from mfsdp_buffers import (
    Allocator,
    FixedPoolAllocator,
    PlainAllocator,
    StorageResizeAllocator,
    TracePoolAllocator,
    has_stable_storage,
)

CPU = torch.device("cpu")
F32 = torch.float32


@pytest.mark.parametrize(
    "allocator",
    [PlainAllocator(), StorageResizeAllocator(), FixedPoolAllocator(), TracePoolAllocator()],
)
def test_protocol_conformance_and_request_checks(allocator: Allocator) -> None:
    assert isinstance(allocator, Allocator)
    t = allocator.allocate("k", 10, torch.bfloat16, CPU)
    assert t.shape == (10,) and t.dtype == torch.bfloat16 and t.device == CPU
    allocator.free("k", t)
    with pytest.raises(ValueError, match="numel"):
        allocator.allocate("k", -1, F32, CPU)
    with pytest.raises(TypeError, match="device"):
        allocator.allocate("k", 1, F32, "cpu")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"dtype must be a torch\.dtype, got 'float32'"):
        allocator.allocate("k", 1, "float32", CPU)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "allocator",
    [PlainAllocator(), StorageResizeAllocator(), FixedPoolAllocator(), TracePoolAllocator()],
)
def test_stable_storage_is_claimed_exactly_where_views_outlive_a_free(allocator: Allocator) -> None:
    # The engine skips re-pointing parameters after a gather only where this holds: a view
    # taken once (a parameter's .data) sees what the next allocation of the key holds.
    first = allocator.allocate("k", 8, F32, CPU)
    view = first[:4]
    allocator.free("k", first)
    again = allocator.allocate("k", 8, F32, CPU).fill_(3.0)
    assert has_stable_storage(allocator) == (again is first and bool((view == 3.0).all()))


def test_plain_allocates_fresh_tensors() -> None:
    alloc = PlainAllocator()
    a = alloc.allocate("k", 4, F32, CPU)
    b = alloc.allocate("k", 4, F32, CPU)
    assert a.data_ptr() != b.data_ptr()


def test_storage_resize_reuses_one_tensor_per_key() -> None:
    alloc = StorageResizeAllocator()
    a = alloc.allocate("a", 100, F32, CPU)
    b = alloc.allocate("b", 100, F32, CPU)
    assert a.untyped_storage().data_ptr() != b.untyped_storage().data_ptr()
    view = a[10:20]
    alloc.free("a", a)
    assert a.untyped_storage().nbytes() == 0 and not alloc.is_live("a")
    assert view.untyped_storage().nbytes() == 0
    again = alloc.allocate("a", 100, F32, CPU)
    assert again is a and a.untyped_storage().nbytes() == 400 and alloc.is_live("a")
    view.fill_(2.0)
    assert torch.equal(a[10:20], torch.full((10,), 2.0))


def test_storage_resize_misuse_is_an_error() -> None:
    alloc = StorageResizeAllocator()
    a = alloc.allocate("a", 8, F32, CPU)
    with pytest.raises(RuntimeError, match="already allocated"):
        alloc.allocate("a", 8, F32, CPU)
    with pytest.raises(RuntimeError, match="not allocated by this allocator"):
        alloc.free("a", torch.empty(8))
    alloc.free("a", a)
    with pytest.raises(RuntimeError, match="already freed"):
        alloc.free("a", a)
    with pytest.raises(ValueError, match="distinct key"):
        alloc.allocate("a", 9, F32, CPU)


def test_storage_resize_zero_numel() -> None:
    alloc = StorageResizeAllocator()
    t = alloc.allocate("z", 0, F32, CPU)
    alloc.free("z", t)
    assert alloc.allocate("z", 0, F32, CPU) is t


def test_fixed_pool_double_buffer_round_robin() -> None:
    pool = FixedPoolAllocator(num_slots=2)
    a = pool.allocate("u0", 16, F32, CPU)
    b = pool.allocate("u1", 16, F32, CPU)
    assert a.data_ptr() != b.data_ptr()
    with pytest.raises(RuntimeError, match=r"all 2 slots .* are in use"):
        pool.allocate("u2", 16, F32, CPU)
    pool.free("u0", a)
    c = pool.allocate("u2", 16, F32, CPU)
    assert c is a  # the freed slot, persistent storage
    pool.free("u1", b)
    pool.free("u2", c)
    # Round-robin: with both free, the next slot after the last handed out comes first.
    assert pool.allocate("u3", 16, F32, CPU) is b
    assert pool.allocate("u4", 16, F32, CPU) is a
    # Another size class gets its own slots; memory is persistent and bounded.
    d = pool.allocate("x", 8, F32, CPU)
    assert d.numel() == 8 and pool.num_allocated_slots() == 3


def test_fixed_pool_errors_and_factory() -> None:
    made: list[int] = []

    def factory(numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        made.append(numel)
        return torch.zeros(numel, dtype=dtype, device=device)

    pool = FixedPoolAllocator(1, factory=factory)
    t = pool.allocate("k", 5, F32, CPU)
    assert made == [5] and torch.equal(t, torch.zeros(5))
    pool.free("k", t)
    assert pool.allocate("k", 5, F32, CPU) is t and made == [5]
    with pytest.raises(RuntimeError, match="not a slot"):
        pool.free("k", torch.empty(5))
    pool.free("k", t)
    with pytest.raises(RuntimeError, match="already free"):
        pool.free("k", t)
    with pytest.raises(ValueError, match="num_slots"):
        FixedPoolAllocator(0)
    bad = FixedPoolAllocator(factory=lambda n, d, dev: torch.empty(n + 1, dtype=d, device=dev))
    with pytest.raises(RuntimeError, match="factory returned"):
        bad.allocate("k", 3, F32, CPU)
