"""What the wrap-time agreement check tells a user whose ranks built different models.

Wraps pair up by order. When one rank's model has more units (a deeper model, or
``fsdp_unit_modules`` that match more of its modules), the rank with fewer reaches its
root while its peers still wrap units: the check then compares, say, a ``TinyLM`` with a
``Block``, which is true but misleading. Each rank therefore also says how many units are
already wrapped inside the module it wraps; when those counts differ, the error says that
the ranks' models have different numbers of units.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

from torch import nn

from mfsdp_collectives.safety.agreement import RankFacts
from mfsdp_hooks.runtime.unit import units_under

__all__ = ["UNITS_INSIDE", "explain_wrap_mismatch", "units_inside"]

UNITS_INSIDE = "units_inside"
"""The fact ``fully_shard``'s agreement check carries it under."""


def units_inside(target: nn.Module) -> str:
    """``"2 (2 Block)"``: the units already wrapped under ``target`` (rank-independent)."""
    units = units_under(target.modules())
    if not units:
        return "0"
    kinds = Counter(unit.name for unit in units)
    return f"{len(units)} ({', '.join(f'{n} {name}' for name, n in kinds.items())})"


def _count(facts: RankFacts) -> int:
    return int(facts[1].get(UNITS_INSIDE, "0").split()[0])


def _ranks(ranks: Sequence[int], singular: str, plural: str) -> str:
    """``rank 1 wraps`` / ``ranks 1, 3 wrap``."""
    if len(ranks) == 1:
        return f"rank {ranks[0]} {singular}"
    return f"ranks {', '.join(map(str, ranks))} {plural}"


def explain_wrap_mismatch(reports: Sequence[RankFacts]) -> str | None:
    """A sentence for ``check_ranks_agree(explain=...)`` when the ranks wrap modules holding
    different numbers of units; None otherwise (the listed differences say it all).

    The ranks have paired every wrap so far, so those that reached a module around more
    units are the ones whose model has fewer units left to wrap.
    """
    counts = [_count(report) for report in reports]
    if len(set(counts)) == 1:
        return None
    most = max(counts)
    ahead = [rank for (rank, _), n in zip(reports, counts, strict=True) if n == most]
    behind = [(rank, f) for (rank, f), n in zip(reports, counts, strict=True) if n != most]
    module = reports[counts.index(most)][1].get("module", "?")
    others = sorted({f.get("module", "?") for _, f in behind})
    behind_ranks = [rank for rank, _ in behind]
    return (
        f"The ranks' models have different numbers of units, so the modules compared above "
        f"are not the same module: {_ranks(ahead, 'wraps', 'wrap')} {module} around the "
        f"{most} unit(s) wrapped before, while {_ranks(behind_ranks, 'wraps', 'wrap')} "
        f"another {' or '.join(others)}: {_ranks(behind_ranks, 'has', 'have')} more units "
        "(a deeper model, or fsdp_unit_modules that match more of its modules)"
    )
