"""Group parameters into communication buckets, one collective each.

The order is derived only from the input order, never from sets or object ids, because
every rank must issue the same collectives in the same order.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class BucketKey:
    """What parameters must share to travel in one collective."""

    unit: str
    dtype: torch.dtype
    group: str
    requires_grad: bool


@dataclass
class Bucket:
    """Parameters (by index, in input order) that are communicated together."""

    key: BucketKey
    param_indices: list[int] = field(default_factory=list)
    numel: int = 0


def build_buckets(
    params: Sequence[tuple[int, BucketKey, int]], *, max_bucket_numel: int | None = None
) -> list[Bucket]:
    """Bucket ``(param_index, key, numel)`` items.

    Keys come out in order of first appearance and each key's parameters in
    input order. With ``max_bucket_numel``, a key's parameters are split into
    consecutive buckets, a new one starting whenever the next parameter would
    push the current bucket over the cap; a parameter larger than the cap gets
    a bucket of its own (parameters are never split across buckets).
    """
    if max_bucket_numel is not None and (
        isinstance(max_bucket_numel, bool) or max_bucket_numel < 1
    ):
        raise ValueError(f"max_bucket_numel must be >= 1 or None, got {max_bucket_numel!r}")
    seen: set[int] = set()
    by_key: dict[BucketKey, list[Bucket]] = {}  # insertion-ordered: first appearance wins
    for index, key, numel in params:
        if numel < 0:
            raise ValueError(f"parameter {index} has negative numel {numel}")
        if index in seen:
            raise ValueError(f"parameter index {index} appears twice in params")
        seen.add(index)
        buckets = by_key.setdefault(key, [])
        if not buckets or (
            max_bucket_numel is not None
            and buckets[-1].param_indices
            and buckets[-1].numel + numel > max_bucket_numel
        ):
            buckets.append(Bucket(key))
        bucket = buckets[-1]
        bucket.param_indices.append(index)
        bucket.numel += numel
    return [bucket for buckets in by_key.values() for bucket in buckets]
