"""Integer helpers shared by the layout and the pool planner, so both round the same way (an
off-by-one between them would silently break the zero-copy views)."""

from __future__ import annotations

import math


def align_up(value: int, alignment: int) -> int:
    """Smallest multiple of ``alignment`` that is ``>= value`` (``alignment >= 1``)."""
    return -(-value // alignment) * alignment


def ceil_div(numerator: int, denominator: int) -> int:
    """``ceil(numerator / denominator)`` without going through floats (exact for huge sizes)."""
    return -(-numerator // denominator)


def smallest_aligned_shift(offset: int, target: int, alignment: int, modulus: int) -> int:
    """Smallest aligned ``s >= 0`` with ``(target - offset - s) % modulus == 0``.

    ``offset`` and ``target`` must both be multiples of ``alignment`` so that a
    solution exists; it is then unique modulo ``lcm(alignment, modulus)``, which
    bounds the answer by ``lcm(alignment, modulus) - alignment``. The layout uses
    this to push a parameter forward, keeping its start aligned, until a shard
    boundary falls on one of its row edges.
    """
    g = math.gcd(alignment, modulus)
    reduced_modulus = modulus // g
    if reduced_modulus == 1:
        return 0
    residue = (target - offset) % modulus
    # alignment * k == residue (mod modulus)  <=>  (alignment/g) * k == residue/g (mod modulus/g)
    k = (residue // g) * pow(alignment // g, -1, reduced_modulus) % reduced_modulus
    return alignment * k
