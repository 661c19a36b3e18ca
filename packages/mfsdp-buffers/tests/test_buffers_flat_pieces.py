"""FlatPieces reads exactly what the equivalent zero-padded flat tensor holds."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mfsdp_buffers import FlatPieces

CPU = torch.device("cpu")


@st.composite
def _vectors(draw: st.DrawFn) -> tuple[int, list[tuple[int, int]]]:
    cursor, spans = 0, []
    for _ in range(draw(st.integers(0, 5))):
        cursor += draw(st.integers(0, 7))
        size = draw(st.integers(1, 9))
        spans.append((cursor, size))
        cursor += size
    return cursor + draw(st.integers(0, 7)), spans


@settings(max_examples=200, deadline=None)
@given(_vectors(), st.data())
def test_reads_match_the_dense_vector(
    vector: tuple[int, list[tuple[int, int]]], data: st.DataObject
) -> None:
    numel, spans = vector
    pieces = [(offset, torch.randn(size, dtype=torch.float64)) for offset, size in spans]
    exact = torch.zeros(numel, dtype=torch.float64)
    for offset, piece in pieces:
        exact[offset : offset + piece.numel()] = piece
    dense = exact.float()
    flat = FlatPieces(numel, list(reversed(pieces)), dtype=torch.float32, device=CPU)
    assert torch.equal(flat.materialize(), dense)
    start = data.draw(st.integers(0, numel))
    width = data.draw(st.integers(0, numel - start))
    out = torch.full((width,), 7.0)
    flat.copy_range_into(out, start)
    assert torch.equal(out, dense[start : start + width])
    acc = torch.ones(width)
    flat.add_range_into(acc, start)
    # The add happens in the pieces' wider dtype and rounds once.
    assert torch.equal(acc, (1.0 + exact[start : start + width]).float())


def test_overlapping_or_out_of_range_pieces_are_rejected() -> None:
    with pytest.raises(ValueError, match="overlaps another"):
        FlatPieces(10, [(0, torch.ones(4)), (3, torch.ones(2))], dtype=torch.float32, device=CPU)
    with pytest.raises(ValueError, match="runs past numel=10"):
        FlatPieces(10, [(8, torch.ones(4))], dtype=torch.float32, device=CPU)
    with pytest.raises(ValueError, match="must be 1-D"):
        FlatPieces(10, [(0, torch.ones(2, 2))], dtype=torch.float32, device=CPU)
