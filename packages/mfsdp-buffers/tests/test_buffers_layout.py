"""FlatLayout: the invariants the buffers and the collectives rely on."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from mfsdp_buffers import FlatLayout, LocalPiece

_DIM = st.sampled_from([0, 1, 2, 3, 4, 5, 7, 8, 13, 15, 16, 31, 64])
_SHAPE = st.lists(_DIM, min_size=1, max_size=3).map(tuple)
_LEAD = st.integers(min_value=0, max_value=300)
_SHAPES = st.lists(
    st.one_of(_SHAPE, st.tuples(_LEAD), st.tuples(_LEAD, _DIM)), min_size=0, max_size=8
)
_WORLD = st.integers(min_value=1, max_value=8)
_ALIGN = st.sampled_from([1, 4, 16, 64])


def _bound(shapes: list[tuple[int, ...]], world: int, align: int) -> int:
    """The padding bound stated in FlatLayout's docstring, recomputed independently."""
    numels = [math.prod(s) for s in shapes]
    rows = [math.prod(s[1:]) for s in shapes]
    data = sum(numels)
    u = data + sum(math.lcm(align, max(r, 1)) - 1 for r in rows)
    big = -(-data // world)
    step0 = math.lcm(align, *[r for n, r in zip(numels, rows, strict=True) if n > big])
    return u + world * step0 - 1


@given(shapes=_SHAPES, world=_WORLD, align=_ALIGN)
def test_layout_invariants(shapes: list[tuple[int, ...]], world: int, align: int) -> None:
    layout = FlatLayout.build(shapes, world, align)
    s = layout.shard_numel

    # Shards tile [0, padded_numel) exactly, in rank order, and are aligned.
    assert layout.padded_numel == s * world
    assert s % align == 0
    ranges = [layout.shard_range(r) for r in range(world)]
    assert ranges[0][0] == 0 and ranges[-1][1] == layout.padded_numel
    assert all(a[1] == b[0] for a, b in itertools.pairwise(ranges))
    assert all(end - start == s for start, end in ranges)

    # Parameters are in order, aligned, inside the buffer, never overlapping.
    assert layout.data_numel == sum(math.prod(x) for x in shapes)
    cursor = 0
    for i, p in enumerate(layout.placements):
        assert p.index == i and tuple(p.shape) == tuple(shapes[i])
        assert p.numel == math.prod(shapes[i]) and p.row_numel == math.prod(shapes[i][1:])
        assert p.offset >= cursor and p.offset % align == 0
        assert p.offset + p.numel <= layout.padded_numel
        cursor = p.offset + p.numel

    # Padding is bounded.
    assert (
        layout.padded_numel - layout.data_numel <= _bound(shapes, world, align) - layout.data_numel
    )

    # Each parameter's pieces are contiguous row ranges covering all rows in rank order,
    # each inside its rank's shard at the right place.
    for p in layout.placements:
        row_ranges = layout.row_ranges(p.index)
        assert len(row_ranges) == world
        assert row_ranges[0][0] == 0 and row_ranges[-1][1] == p.shape[0]
        for (_, prev_end), (start, _) in itertools.pairwise(row_ranges):
            assert prev_end == start
        for rank in range(world):
            piece = layout.local_piece(p.index, rank)
            assert (piece.row_start, piece.row_end) == row_ranges[rank]
            assert piece.numel == (piece.row_end - piece.row_start) * p.row_numel
            assert 0 <= piece.shard_offset <= piece.shard_offset + piece.numel <= s
            if piece.numel:
                # The piece is exactly the slice of the param that lies in this shard.
                global_start = rank * s + piece.shard_offset
                assert global_start == p.offset + piece.row_start * p.row_numel
                assert piece.is_empty is False
            assert piece.is_empty == (piece.row_start == piece.row_end)
        assert sum(layout.local_piece(p.index, r).numel for r in range(world)) == p.numel


@given(shapes=_SHAPES, world=_WORLD, align=_ALIGN, seed=st.integers(0, 2**16))
def test_shards_and_pieces_reconstruct(
    shapes: list[tuple[int, ...]], world: int, align: int, seed: int
) -> None:
    layout = FlatLayout.build(shapes, world, align)
    gen = torch.Generator().manual_seed(seed)
    flat = torch.randn(layout.padded_numel, generator=gen)
    shards = [flat[slice(*layout.shard_range(r))] for r in range(world)]
    assert torch.equal(torch.cat(shards), flat)
    for p in layout.placements:
        expected = flat[p.offset : p.offset + p.numel].view(p.shape)
        pieces = []
        for rank, piece in enumerate(layout.local_pieces(rank) for rank in range(world)):
            local = piece[p.index]
            assert local.rank == rank and local.param_index == p.index
            rows = local.row_end - local.row_start
            chunk = shards[rank][local.shard_offset : local.shard_offset + local.numel]
            pieces.append(chunk.view(rows, *p.shape[1:]))
        assert torch.equal(torch.cat(pieces), expected)


@given(shapes=_SHAPES, world=_WORLD, align=_ALIGN)
def test_deterministic(shapes: list[tuple[int, ...]], world: int, align: int) -> None:
    a = FlatLayout.build(shapes, world, align)
    b = FlatLayout.build([torch.Size(s) for s in shapes], world, align)
    assert a == b
    assert hash(a) == hash(b)
    assert [a.local_pieces(r) for r in range(world)] == [b.local_pieces(r) for r in range(world)]


def test_world_size_one_is_alignment_padding_only() -> None:
    layout = FlatLayout.build([(10, 4), (3,), (5, 5)], 1, alignment=16)
    assert [p.offset for p in layout.placements] == [0, 48, 64]
    assert layout.shard_numel == 96 == layout.padded_numel
    assert layout.local_piece(2, 0) == LocalPiece(2, 0, 0, 5, 64, 25)


def test_boundary_inside_param_moves_to_row_edge() -> None:
    # 3 + 9 = 12 elements over 2 ranks: a boundary at 6 would cut (3, 3) mid-row at
    # element 3 of it; the layout must put it on a row edge instead.
    layout = FlatLayout.build([(3,), (3, 3)], 2)
    p = layout.placements[1]
    boundary = layout.shard_numel
    assert p.offset < boundary < p.offset + p.numel
    assert (boundary - p.offset) % 3 == 0
    assert layout.row_ranges(1) in {((0, 1), (1, 3)), ((0, 2), (2, 3))}


def test_param_spanning_many_shards() -> None:
    layout = FlatLayout.build([(64, 3), (2,)], 8, alignment=4)
    assert layout.shard_numel % 12 == 0  # multiple of lcm(row_numel, alignment)
    ranges = layout.row_ranges(0)
    assert [end - start for start, end in ranges if end > start]  # non-empty somewhere
    assert ranges[-1][1] == 64


def test_zero_size_params() -> None:
    layout = FlatLayout.build([(0,), (4, 0), (0, 7), (2,)], 2, alignment=4)
    assert [p.numel for p in layout.placements] == [0, 0, 0, 2]
    assert layout.row_ranges(0) == ((0, 0), (0, 0))
    assert layout.row_ranges(1) == ((0, 4), (4, 4))  # rows of 0 elements go to one rank
    assert layout.row_ranges(2) == ((0, 0), (0, 0))
    assert all(layout.local_piece(i, 1).is_empty for i in range(3))


def test_empty_and_all_zero() -> None:
    assert FlatLayout.build([], 4).padded_numel == 0
    layout = FlatLayout.build([(0,), (0, 3)], 3, alignment=16)
    assert layout.shard_numel == 0
    assert layout.local_pieces(2) == (LocalPiece(0, 2, 0, 0, 0, 0), LocalPiece(1, 2, 0, 0, 0, 0))


def test_errors() -> None:
    with pytest.raises(ValueError, match=r"parameter 1 is 0-d.*reshape to \(1,\)"):
        FlatLayout.build([(2,), ()], 2)
    with pytest.raises(ValueError, match="parameter 0 is 0-d"):
        FlatLayout.build([torch.Size([])], 1)
    with pytest.raises(ValueError, match="world_size"):
        FlatLayout.build([(2,)], 0)
    with pytest.raises(ValueError, match="alignment"):
        FlatLayout.build([(2,)], 1, alignment=0)
    with pytest.raises(ValueError, match="negative"):
        FlatLayout.build([(2, -1)], 1)
    with pytest.raises(TypeError, match="shapes\\[0\\]"):
        FlatLayout.build([(2.5,)], 1)  # type: ignore[list-item]
    layout = FlatLayout.build([(4,)], 2)
    with pytest.raises(IndexError):
        layout.shard_range(2)
    with pytest.raises(IndexError):
        layout.local_piece(1, 0)


def test_direct_construction_is_validated() -> None:
    layout = FlatLayout.build([(3,), (3, 3)], 2)
    p = layout.placements[1]
    bad = type(p)(p.index, p.shape, p.offset + 1, p.numel, p.row_numel)
    with pytest.raises(ValueError, match="placement 1 at offset 4 is misplaced or misaligned"):
        FlatLayout((layout.placements[0], bad), 2, 1, layout.shard_numel)
    placements, shard = layout.placements, layout.shard_numel
    with pytest.raises(ValueError, match="world_size must be >= 1, got 0"):
        FlatLayout(placements, 0, 1, shard)
    with pytest.raises(ValueError, match="alignment must be >= 1, got 0"):
        FlatLayout(placements, 2, 0, shard)
    with pytest.raises(ValueError, match="shard_numel must be a non-negative multiple of align"):
        FlatLayout(placements, 2, 4, 6)
    with pytest.raises(ValueError, match=r"placements\[0\] has index 1; expected 0"):
        FlatLayout((p,), 2, 1, shard)
    # 3 + 9 elements in shards of 7 and 5: the boundary at 7 falls inside the (3, 3)'s row 1
    with pytest.raises(ValueError, match=r"shard boundary 7 cuts parameter 1 \(shape \(3, 3\)\)"):
        FlatLayout(placements, 2, 1, 7)


@given(shapes=_SHAPES, world=_WORLD, align=_ALIGN)
def test_padding_gaps_and_parameters_tile_the_buffer(
    shapes: list[tuple[int, ...]], world: int, align: int
) -> None:
    layout = FlatLayout.build(shapes, world, align)
    covered = torch.zeros(layout.padded_numel, dtype=torch.int32)
    for p in layout.placements:
        covered[p.offset : p.offset + p.numel] += 1
    for start, end in layout.padding_gaps():
        assert start < end
        covered[start:end] += 1
    assert bool((covered == 1).all())  # every element: exactly one parameter or one gap


@given(shapes=_SHAPES, shard=st.integers(1, 4), outer=st.integers(1, 4), align=_ALIGN)
def test_a_merged_layout_cuts_each_shard_into_its_sub_shards(
    shapes: list[tuple[int, ...]], shard: int, outer: int, align: int
) -> None:
    # HFSDP: a dp_shard rank's compute shard is the concatenation of the sub-shards its
    # dp_outer peers hold, parameter by parameter (row ranges tile in sub-shard order).
    fine = FlatLayout.build(shapes, shard * outer, align)
    coarse = fine.merged(outer)
    assert coarse.world_size == shard and coarse.padded_numel == fine.padded_numel
    for rank in range(shard):
        start, end = coarse.shard_range(rank)
        subs = [fine.shard_range(rank * outer + o) for o in range(outer)]
        assert subs[0][0] == start and subs[-1][1] == end
        for index in range(fine.num_params):
            whole = coarse.local_piece(index, rank)
            parts = [fine.local_piece(index, rank * outer + o) for o in range(outer)]
            if whole.numel:
                assert sum(p.numel for p in parts) == whole.numel
                rows = [(p.row_start, p.row_end) for p in parts if p.numel]
                assert rows[0][0] == whole.row_start and rows[-1][1] == whole.row_end
                assert all(a[1] == b[0] for a, b in itertools.pairwise(rows))


def test_merged_refuses_a_factor_that_does_not_divide_the_world() -> None:
    with pytest.raises(ValueError, match="factor=3 must be a positive divisor of world_size=4"):
        FlatLayout.build([(8, 2)], 4).merged(3)


@given(shapes=_SHAPES, world=_WORLD, align=_ALIGN, seed=st.integers(0, 2**16))
def test_a_parameter_cut_along_another_dim_is_stored_with_that_dim_first(
    shapes: list[tuple[int, ...]], world: int, align: int, seed: int
) -> None:
    """FSDP2's ``Shard(d)``: each rank's piece is a range along ``d`` of the parameter, and
    the views are the user's shape over storage that holds ``d`` first."""
    gen = torch.Generator().manual_seed(seed)
    dims = [int(torch.randint(len(s), (1,), generator=gen)) for s in shapes]
    layout = FlatLayout.build(shapes, world, align, shard_dims=dims)
    flat = torch.randn(layout.padded_numel, generator=gen)
    for p, dim in zip(layout.placements, dims, strict=True):
        assert p.shard_dim == dim and p.num_rows == p.shape[dim]
        whole = p.rows_view(flat[p.offset : p.end])
        assert whole.shape == p.shape
        assert torch.equal(p.flatten(whole), flat[p.offset : p.end])
        for rank in range(world):
            piece = layout.local_piece(p.index, rank)
            start = rank * layout.shard_numel + piece.shard_offset
            local = p.rows_view(flat[start : start + piece.numel], piece.num_rows)
            assert torch.equal(local, p.rows_of(whole, piece.row_start, piece.row_end))


def test_shard_dims_must_name_a_dim_of_each_shape() -> None:
    with pytest.raises(ValueError, match=r"shard_dims\[1\]=2 is not a dim .* shape \(3, 4\)"):
        FlatLayout.build([(2, 2), (3, 4)], 2, shard_dims=[1, 2])
    with pytest.raises(ValueError, match="shard_dims has 1 dims for 2 shapes"):
        FlatLayout.build([(2, 2), (3, 4)], 2, shard_dims=[1])
    layout = FlatLayout.build([(2, 6), (3, 4)], 2, shard_dims=[-1, 0])
    assert [p.shard_dim for p in layout.placements] == [1, 0]
    assert layout.placements[0].stored_shape == torch.Size([6, 2])
