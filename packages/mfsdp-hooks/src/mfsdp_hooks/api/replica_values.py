"""Replicas start alike: the values each rank's parameters hold, compared at wrap time.

Sharding takes each rank's slice of *its own* copy of a weight. When the ranks built their
models with different seeds, ZeRO-3 trains a patchwork of their initial weights, ZeRO-1/2
step different weights on each rank, and ZeRO-0 keeps replicas that never meet: every one a
silent wrong result (FSDP2 does the same; DDP broadcasts rank 0's weights at construction).
So the wrap's agreement check (``fully_shard``'s one exchange before its first collective)
also carries a digest of every parameter's values: no collective more, and a disagreement
is an error on every rank naming the first parameter that differs and the fix.

The digest must be equal on equal values whatever the rank's device, thread count or
summation order, and must not copy a model to the host: each tensor's bits, read as
integers, are summed (and summed again weighted by position, so a permutation shows) in
int64, whose wrap-around arithmetic is exact in any order. Meta tensors (nothing to
compare yet), expert parameters (each expert-parallel rank holds other experts) and tensor
subclasses other than ``DTensor`` (their bits are not in their storage) are left out.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from mfsdp_collectives.safety.agreement import RankFacts

__all__ = ["WEIGHTS", "explain_weight_mismatch", "weight_digests"]

WEIGHTS = "weights"
"""The fact the agreement check carries the digest of the values under."""

_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_POSITION_MODULUS = 65521  # a prime: the position weights cycle through 1..65521
_CHUNK = 1 << 20  # elements per pass: the int64 temporaries stay within 32 MiB


def _plain_values(param: torch.Tensor) -> torch.Tensor | None:
    """The tensor whose bits are compared, or None for what is left out."""
    value = param.detach()
    if isinstance(value, DTensor):  # tensor parallel: this rank's TP shard, equal over DP
        value = value.to_local()
    if value.is_meta or type(value) not in (torch.Tensor, nn.Parameter):
        return None
    return value.reshape(-1)


def _bit_sums(flat: torch.Tensor) -> torch.Tensor:
    """[sum of bits, position-weighted sum of bits] in int64, on ``flat``'s device."""
    if flat.dtype == torch.bool:
        flat = flat.to(torch.uint8)
    elif flat.dtype.is_floating_point or flat.dtype.is_complex:
        flat = flat.view(_INT_OF_SIZE[flat.element_size()])
    sums = torch.zeros(2, dtype=torch.int64, device=flat.device)
    for start in range(0, flat.numel(), _CHUNK):
        bits = flat[start : start + _CHUNK].to(torch.int64)
        positions = torch.arange(start, start + bits.numel(), device=bits.device)
        sums[0] += bits.sum()
        sums[1] += (bits * (positions % _POSITION_MODULUS + 1)).sum()
    return sums


def weight_digests(
    named_params: Sequence[tuple[str, nn.Parameter]], is_expert: Callable[[str, nn.Parameter], bool]
) -> list[str]:
    """One line per compared parameter, ``"name sum/weighted-sum"`` (one device sync)."""
    names, sums = [], []
    for name, param in named_params:
        flat = _plain_values(param)
        if flat is None or is_expert(name, param):
            continue
        names.append(name)
        sums.append(_bit_sums(flat))
    if not sums:
        return []
    values = torch.stack(sums).cpu().tolist()
    return [
        f"{name} {a & 0xFFFFFFFFFFFFFFFF:x}/{b & 0xFFFFFFFFFFFFFFFF:x}"
        for name, (a, b) in zip(names, values, strict=True)
    ]


def summarise(lines: Sequence[str]) -> str:
    """The fact compared across ranks: a short digest of every line."""
    return hashlib.sha256("\n".join(lines).encode()).hexdigest()[:16] if lines else "none"


def explain_weight_mismatch(reports: Sequence[RankFacts]) -> str | None:
    """What a difference in ``WEIGHTS`` alone means, and the fixes (None otherwise)."""
    facts = [f for _, f in reports]
    differing = {key for key in facts[0] if len({f.get(key) for f in facts}) > 1}
    if differing != {WEIGHTS}:
        return None
    return (
        "The ranks hold different values for the same parameters (initialised with "
        "different seeds, or loaded from different files): sharded, each rank would train "
        "its own slice of its own weights. Seed every rank alike before building the model "
        "(torch.manual_seed), or load the same weights on every rank before wrapping; "
        "if you load the weights into the sharded model after wrapping, pass "
        "check_replicas=False"
    )
