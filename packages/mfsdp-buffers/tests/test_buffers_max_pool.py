"""MaxPoolAllocator (one pool sized for the largest request) and the pools' fallback when no
slot can serve (``on_full``: raise, dynamic, persistent)."""

from __future__ import annotations

import pytest
import torch

from mfsdp_buffers import FixedPoolAllocator, MaxPoolAllocator

F32, BF16, CPU = torch.float32, torch.bfloat16, torch.device("cpu")


def test_max_pool_keeps_num_slots_of_the_largest_request_per_dtype() -> None:
    pool = MaxPoolAllocator(num_slots=2)
    # An iteration's requests: two layer-sized units, then a larger head, in turn.
    for _ in range(3):
        for key, numel in (("layer1", 100), ("layer0", 100), ("head", 300)):
            lent = pool.allocate(key, numel, F32, CPU)
            assert lent.numel() == numel
            pool.free(key, lent)
    assert pool.reserved_bytes() == 2 * 300 * 4
    fixed = FixedPoolAllocator(num_slots=2)
    for key, numel in (("layer1", 100), ("layer0", 100), ("head", 300)) * 3:
        fixed.free(key, fixed.allocate(key, numel, F32, CPU))
    assert fixed.reserved_bytes() == 2 * (100 + 300) * 4  # slots of every size
    # Each dtype has a pool of its own.
    pool.free("b", pool.allocate("b", 10, BF16, CPU))
    assert pool.reserved_bytes() == 2 * 300 * 4 + 10 * 2


def test_max_pool_serves_the_front_of_a_slot_and_grows_only_free_slots() -> None:
    pool = MaxPoolAllocator(num_slots=2)
    a = pool.allocate("a", 8, F32, CPU)
    b = pool.allocate("b", 4, F32, CPU)
    assert a.untyped_storage().data_ptr() != b.untyped_storage().data_ptr()
    with pytest.raises(RuntimeError, match=r"all 2 slots .* are in use"):
        pool.allocate("c", 4, F32, CPU)
    pool.free("b", b)
    c = pool.allocate("c", 16, F32, CPU)  # b's slot was free and too small: grown
    assert c.numel() == 16 and pool.reserved_bytes() == (8 + 16) * 4
    pool.free("a", a)
    d = pool.allocate("d", 2, F32, CPU)  # served from the front of a slot
    assert d.numel() == 2 and d.untyped_storage().data_ptr() == a.untyped_storage().data_ptr()
    with pytest.raises(RuntimeError, match="not lent out"):
        pool.free("d", torch.empty(2))
    pool.free("d", d)
    with pytest.raises(RuntimeError, match="not lent out"):
        pool.free("d", d)


@pytest.mark.parametrize("make", [FixedPoolAllocator, MaxPoolAllocator])
def test_dynamic_fallback_allocates_afresh_and_keeps_nothing(make: type) -> None:
    pool = make(num_slots=1, on_full="dynamic")
    slot = pool.allocate("a", 8, F32, CPU)
    extra = pool.allocate("b", 8, F32, CPU)  # every slot held: a fresh tensor
    assert extra.untyped_storage().data_ptr() != slot.untyped_storage().data_ptr()
    assert pool.fallback.requests_served == 1
    pool.free("b", extra)
    again = pool.allocate("b", 8, F32, CPU)
    assert pool.reserved_bytes() == 8 * 4  # the slot only: dynamic memory is not kept
    pool.free("b", again)
    pool.free("a", slot)


@pytest.mark.parametrize("make", [FixedPoolAllocator, MaxPoolAllocator])
def test_persistent_fallback_gives_each_requester_its_own_kept_buffer(make: type) -> None:
    made: list[int] = []

    def factory(numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        made.append(numel)
        return torch.empty(numel, dtype=dtype, device=device)

    pool = make(num_slots=1, on_full="persistent", factory=factory)
    for _ in range(3):  # three iterations: "a" holds the slot while "b" and "c" need memory
        slot = pool.allocate("a", 8, F32, CPU)
        b = pool.allocate("b", 8, F32, CPU)
        c = pool.allocate("c", 8, F32, CPU)
        assert len({t.untyped_storage().data_ptr() for t in (slot, b, c)}) == 3
        for key, tensor in (("c", c), ("b", b), ("a", slot)):
            pool.free(key, tensor)
    assert made == [8, 8, 8]  # made once, reused every iteration
    assert pool.reserved_bytes() == 3 * 8 * 4
    assert pool.fallback.requests_served == 6


def test_bad_on_full_is_refused() -> None:
    with pytest.raises(ValueError, match="on_full"):
        MaxPoolAllocator(on_full="grow")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="num_slots"):
        MaxPoolAllocator(num_slots=0)
