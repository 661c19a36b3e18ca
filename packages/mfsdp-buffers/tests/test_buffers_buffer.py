"""DataParallelBuffer: zero-copy views, materialize/release cycles, copy-in."""

from __future__ import annotations

from collections.abc import Hashable

import pytest
import torch

from mfsdp_buffers import (
    BufferRole,
    DataParallelBuffer,
    FixedPoolAllocator,
    FlatLayout,
    PlainAllocator,
    StorageResizeAllocator,
    TracePoolAllocator,
)

CPU = torch.device("cpu")
SHAPES = [(7, 15), (3,), (0, 4), (11, 13), (4, 0), (64,), (2, 3, 5)]


def _params(seed: int = 0, dtype: torch.dtype = torch.float32) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=gen).to(dtype) for s in SHAPES]


def _buffers(
    world: int, *, sharded: bool, dtype: torch.dtype = torch.float32, alignment: int = 4
) -> tuple[FlatLayout, list[DataParallelBuffer]]:
    layout = FlatLayout.build(SHAPES, world, alignment)
    bufs = [
        DataParallelBuffer(
            layout, r, dtype=dtype, device=CPU, role=BufferRole.MODEL_WEIGHT, sharded=sharded
        )
        for r in range(world)
    ]
    return layout, bufs


def _storage_ptr(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def _fake_all_gather(bufs: list[DataParallelBuffer]) -> None:
    """What the collectives layer does: every rank's shard into every unsharded buffer."""
    for dst in bufs:
        full = dst.materialize()
        for src in bufs:
            start, end = src.layout.shard_range(src.rank)
            full[start:end].copy_(src.shard)


@pytest.mark.parametrize("world", [1, 2, 3, 5, 8])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sharded_roundtrip(world: int, dtype: torch.dtype) -> None:
    params = _params()
    layout, bufs = _buffers(world, sharded=True, dtype=dtype)
    for b in bufs:
        assert b.shard.shape == (layout.shard_numel,) and b.shard.dtype == dtype
        assert not b.is_materialized and b.unsharded is None
        b.copy_params_in(params)
        for i, p in enumerate(params):
            start, end = layout.row_ranges(i)[b.rank]
            view = b.local_view(i)
            assert view.shape == (end - start, *p.shape[1:])
            assert torch.equal(view, p[start:end].to(dtype))
    _fake_all_gather(bufs)
    for b in bufs:
        for i, p in enumerate(params):
            assert torch.equal(b.unsharded_view(i), p.to(dtype))
        # Padding stays zero: only parameter bytes were written.
        total = sum(b.unsharded_view(i).numel() for i in range(len(params)))
        assert total == layout.data_numel


def test_views_share_storage_no_copies() -> None:
    _, bufs = _buffers(3, sharded=True)
    b = bufs[1]
    shard_ptr = _storage_ptr(b.shard)
    for i in range(len(SHAPES)):
        assert _storage_ptr(b.local_view(i)) == shard_ptr
    full = b.materialize()
    for i in range(len(SHAPES)):
        assert _storage_ptr(b.unsharded_view(i)) == _storage_ptr(full)
    assert _storage_ptr(b.unsharded_shard_view()) == _storage_ptr(full)
    # A write through a view is visible in the buffer: it is the same memory.
    nonempty = next(i for i in range(len(SHAPES)) if b.local_view(i).numel())
    b.local_view(nonempty).fill_(3.0)
    assert int((b.shard == 3.0).sum()) == b.local_view(nonempty).numel()
    b.unsharded_view(5).fill_(7.0)
    p = b.layout.placements[5]
    assert torch.equal(full[p.offset : p.offset + p.numel], torch.full((64,), 7.0))
    start, _ = b.layout.shard_range(1)
    assert b.unsharded_shard_view().data_ptr() == full.data_ptr() + start * full.element_size()


def test_release_frees_and_materialize_restores_same_storage() -> None:
    _, bufs = _buffers(2, sharded=True)
    b = bufs[0]
    full = b.materialize()
    assert b.materialize() is full  # idempotent while materialized
    view = b.unsharded_view(3)  # what the engine would store in param.data
    nbytes = full.untyped_storage().nbytes()
    assert nbytes == b.layout.padded_numel * 4
    b.release()
    assert not b.is_materialized and b.unsharded is None
    assert full.untyped_storage().nbytes() == 0
    assert view.untyped_storage().nbytes() == 0
    again = b.materialize()
    assert again is full and b.stable_storage
    assert full.untyped_storage().nbytes() == nbytes
    view.fill_(1.5)  # the old view is usable again and aliases the new bytes
    assert torch.equal(b.unsharded_view(3), view)
    b.release()
    b.release()  # releasing a released buffer is a no-op


def test_unsharded_access_requires_materialize() -> None:
    _, bufs = _buffers(2, sharded=True)
    with pytest.raises(RuntimeError, match="not materialized"):
        bufs[0].unsharded_view(0)
    with pytest.raises(RuntimeError, match="not materialized"):
        bufs[0].unsharded_shard_view()


def test_not_sharded_buffer_is_persistent() -> None:
    params = _params(1)
    layout, bufs = _buffers(4, sharded=False)
    b = bufs[2]
    assert b.is_materialized
    full = b.materialize()
    assert full.shape == (layout.padded_numel,)
    assert _storage_ptr(b.shard) == _storage_ptr(full)
    start, end = layout.shard_range(2)
    assert b.shard.data_ptr() == full[start:end].data_ptr()
    b.copy_params_in(params)
    for i, p in enumerate(params):
        assert torch.equal(b.unsharded_view(i), p)
        piece = layout.local_piece(i, 2)
        assert torch.equal(b.local_view(i), p[piece.row_start : piece.row_end])
    b.release()  # no-op
    assert b.is_materialized and b.materialize() is full and b.stable_storage


def test_empty_pieces_have_row_shaped_views() -> None:
    layout, bufs = _buffers(8, sharded=True)
    empties = 0
    for b in bufs:
        for i, s in enumerate(SHAPES):
            piece = layout.local_piece(i, b.rank)
            view = b.local_view(i)
            assert view.shape == (piece.row_end - piece.row_start, *s[1:])
            if piece.is_empty:
                empties += 1
                assert view.shape[0] == 0 and view.numel() == 0
    assert empties > 0


def test_copy_params_in_checks_and_is_outside_autograd() -> None:
    _, bufs = _buffers(2, sharded=True)
    params = [p.requires_grad_() for p in _params()]
    bufs[0].copy_params_in(params)
    assert not bufs[0].shard.requires_grad and bufs[0].shard.grad_fn is None
    with pytest.raises(ValueError, match="expected 7 tensors"):
        bufs[0].copy_params_in(params[:-1])
    with pytest.raises(ValueError, match=r"tensors\[1\] has shape"):
        bufs[0].copy_params_in([params[0], torch.zeros(4), *params[2:]])


def test_constructor_errors() -> None:
    layout = FlatLayout.build([(4,)], 2)
    with pytest.raises(ValueError, match="rank"):
        DataParallelBuffer(
            layout, 2, dtype=torch.float32, device=CPU, role=BufferRole.MAIN_GRAD, sharded=True
        )


class _WrongSize:
    def allocate(
        self, key: Hashable, numel: int, dtype: torch.dtype, device: torch.device
    ) -> torch.Tensor:
        return torch.empty(numel + 1, dtype=dtype, device=device)

    def free(self, key: Hashable, tensor: torch.Tensor) -> None:
        pass


def test_allocator_result_is_checked() -> None:
    layout = FlatLayout.build([(4,)], 2)
    b = DataParallelBuffer(
        layout,
        0,
        dtype=torch.float32,
        device=CPU,
        role=BufferRole.MAIN_GRAD,
        sharded=True,
        allocator=_WrongSize(),
    )
    with pytest.raises(RuntimeError, match="expected"):
        b.materialize()


@pytest.mark.parametrize(
    "make", [PlainAllocator, StorageResizeAllocator, FixedPoolAllocator, TracePoolAllocator]
)
def test_every_allocator_roundtrips_through_a_buffer(make: type) -> None:
    params = _params(2)
    layout = FlatLayout.build(SHAPES, 2, 4)
    allocator = make()
    bufs = [
        DataParallelBuffer(
            layout,
            r,
            dtype=torch.float32,
            device=CPU,
            role=BufferRole.MAIN_WEIGHT,
            sharded=True,
            allocator=allocator,
            name="w",
        )
        for r in range(2)
    ]
    assert bufs[0].alloc_key != bufs[1].alloc_key  # distinct keys despite equal names
    for _ in range(3):
        for b in bufs:
            b.copy_params_in(params)
        _fake_all_gather(bufs)
        for b in bufs:
            for i, p in enumerate(params):
                assert torch.equal(b.unsharded_view(i), p)
        for b in bufs:
            b.release()
        if isinstance(allocator, TracePoolAllocator):
            allocator.end_iteration()


def test_without_persistent_shard_nothing_persists_and_shard_is_the_unsharded_slot() -> None:
    layout = FlatLayout.build([(5, 3), (4,)], world_size=2, alignment=4)
    buffer = DataParallelBuffer(
        layout,
        1,
        dtype=torch.bfloat16,
        device=torch.device("cpu"),
        role=BufferRole.MODEL_WEIGHT,
        sharded=True,
        persistent_shard=False,
    )
    assert not buffer.has_persistent_shard
    with pytest.raises(RuntimeError, match="not materialized"):
        _ = buffer.shard
    full = buffer.materialize()
    start, end = layout.shard_range(1)
    assert buffer.shard.data_ptr() == full[start:end].data_ptr()
    assert buffer.shard.numel() == layout.shard_numel
    buffer.release()
    assert full.untyped_storage().nbytes() == 0
    with pytest.raises(RuntimeError, match="no persistent shard"):
        buffer.copy_params_in([torch.zeros(5, 3), torch.zeros(4)])
    with pytest.raises(ValueError, match="persistent_shard=False needs sharded=True"):
        DataParallelBuffer(
            layout,
            0,
            dtype=torch.float32,
            device=torch.device("cpu"),
            role=BufferRole.MODEL_WEIGHT,
            sharded=False,
            persistent_shard=False,
        )
