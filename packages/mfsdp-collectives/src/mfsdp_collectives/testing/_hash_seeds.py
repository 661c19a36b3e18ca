"""Ranks with their own ``PYTHONHASHSEED``, as under torchrun, for ``run_distributed``: forked
ranks share string hashing, so a set iterates in one order on every rank, and code whose
collectives pair values by such an order passes there and fails under torchrun. The variable
is read when an interpreter starts: a seeded rank is spawned fresh with it in its environment.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Sequence

_MAX_SEED = 4294967295


def check_hash_seeds(hash_seeds: object, world_size: int) -> None:
    if hash_seeds is None:
        return
    if not (
        isinstance(hash_seeds, Sequence)
        and len(hash_seeds) == world_size
        and all(
            isinstance(s, int) and not isinstance(s, bool) and 0 <= s <= _MAX_SEED
            for s in hash_seeds
        )
    ):
        raise ValueError(
            f"hash_seeds must be one PYTHONHASHSEED (an int in [0, {_MAX_SEED}]) per rank, "
            f"{world_size} in all, or None; got {hash_seeds!r}"
        )


@contextlib.contextmanager
def hash_seed(seed: int | None) -> Iterator[None]:
    """``PYTHONHASHSEED=seed`` in this process's environment (nothing for None), which a
    process spawned inside inherits."""
    if seed is None:
        yield
        return
    saved = os.environ.get("PYTHONHASHSEED")
    os.environ["PYTHONHASHSEED"] = str(seed)
    try:
        yield
    finally:
        if saved is None:
            del os.environ["PYTHONHASHSEED"]
        else:
            os.environ["PYTHONHASHSEED"] = saved
