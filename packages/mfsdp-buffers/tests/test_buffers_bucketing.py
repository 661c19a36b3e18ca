"""build_buckets: grouping, order, size cap, determinism."""

from __future__ import annotations

import itertools

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from mfsdp_buffers import Bucket, BucketKey, build_buckets

A = BucketKey("layer0", torch.bfloat16, "dp", True)
B = BucketKey("layer0", torch.float32, "dp", True)
C = BucketKey("layer1", torch.bfloat16, "dp", True)
D = BucketKey("layer0", torch.bfloat16, "dp", False)


def test_groups_by_key_in_first_appearance_order() -> None:
    params = [(0, B, 4), (1, A, 2), (2, B, 3), (3, C, 5), (4, A, 1), (5, D, 7)]
    buckets = build_buckets(params)
    assert [(b.key, b.param_indices, b.numel) for b in buckets] == [
        (B, [0, 2], 7),
        (A, [1, 4], 3),
        (C, [3], 5),
        (D, [5], 7),
    ]


def test_equal_keys_built_separately_share_a_bucket() -> None:
    a2 = BucketKey("layer0", torch.bfloat16, "dp", True)
    assert a2 == A and a2 is not A
    assert build_buckets([(0, A, 1), (1, a2, 1)]) == [Bucket(A, [0, 1], 2)]


def test_cap_splits_and_oversized_params_stand_alone() -> None:
    params = [(0, A, 3), (1, A, 3), (2, A, 3), (3, A, 10), (4, A, 1), (5, A, 0), (6, B, 6)]
    buckets = build_buckets(params, max_bucket_numel=6)
    assert [(b.key, b.param_indices, b.numel) for b in buckets] == [
        (A, [0, 1], 6),
        (A, [2], 3),
        (A, [3], 10),
        (A, [4, 5], 1),
        (B, [6], 6),
    ]


def test_errors() -> None:
    with pytest.raises(ValueError, match="max_bucket_numel"):
        build_buckets([(0, A, 1)], max_bucket_numel=0)
    with pytest.raises(ValueError, match="appears twice"):
        build_buckets([(0, A, 1), (0, B, 1)])
    with pytest.raises(ValueError, match="negative"):
        build_buckets([(0, A, -1)])
    assert build_buckets([]) == []


_KEYS = st.sampled_from([A, B, C, D])


@given(
    items=st.lists(st.tuples(_KEYS, st.integers(0, 50)), max_size=30),
    cap=st.one_of(st.none(), st.integers(1, 80)),
)
def test_properties(items: list[tuple[BucketKey, int]], cap: int | None) -> None:
    params = [(i, key, n) for i, (key, n) in enumerate(items)]
    buckets = build_buckets(params, max_bucket_numel=cap)
    assert buckets == build_buckets(list(params), max_bucket_numel=cap)  # deterministic
    # Every parameter exactly once, in its key's bucket, order preserved within a key.
    for key in dict.fromkeys(k for _, k, _ in params):
        expected = [i for i, k, _ in params if k == key]
        got = [i for b in buckets if b.key == key for i in b.param_indices]
        assert got == expected
    # Keys appear in first-appearance order and a key's buckets are consecutive.
    first_seen = list(dict.fromkeys(k for _, k, _ in params))
    assert list(dict.fromkeys(b.key for b in buckets)) == first_seen
    numel = {i: n for i, _, n in params}
    for b in buckets:
        assert b.param_indices and b.numel == sum(numel[i] for i in b.param_indices)
        if cap is not None and len(b.param_indices) > 1:
            assert b.numel <= cap
    if cap is not None:
        # Greedy: a bucket was only closed because the next parameter did not fit.
        for prev, nxt in itertools.pairwise(buckets):
            if prev.key == nxt.key:
                assert prev.numel + numel[nxt.param_indices[0]] > cap
    else:
        assert len(buckets) == len(first_seen)
