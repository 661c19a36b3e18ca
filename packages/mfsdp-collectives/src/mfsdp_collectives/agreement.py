"""Check at wrap time that every rank is about to do the same thing.

Collectives pair up by order: if one rank wraps another model, other ``fsdp_unit_modules``
or another strategy, its first differing collective meets a different one on its peers,
and the job hangs or, worse, trains on garbage. A single small exchange before the first
collective of a wrap turns that into an error on every rank that names what differs.

The same exchange tells each rank its peers' processes (``liveness``), so that a rank that
later dies is named by the survivors on every transport.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import cast

import torch.distributed as dist

from .liveness import ProcessIdentity, naming_dead_peers, record_identities
from .naming import group_name

__all__ = ["RankMismatchError", "check_ranks_agree"]

_SHOWN_VALUE_CHARS = 160


class RankMismatchError(ValueError):
    """The ranks of a group were asked to do different things (raised on every rank)."""


def _short(value: str) -> str:
    return value if len(value) <= _SHOWN_VALUE_CHARS else value[:_SHOWN_VALUE_CHARS] + "..."


def check_ranks_agree(group: dist.ProcessGroup, facts: Mapping[str, str], *, what: str) -> None:
    """Raise ``RankMismatchError`` on every rank unless all ranks of ``group`` pass equal
    ``facts`` (collective over ``group``; one ``all_gather_object``).

    ``what`` names the call being checked ("fully_shard(Block)"); the error lists each
    differing fact with the value every rank gave.
    """
    mine = (ProcessIdentity.of_this_process(), dict(facts))
    found: list[object] = [None] * dist.get_world_size(group)
    with naming_dead_peers(f"the agreement check of {what}", group):
        dist.all_gather_object(found, mine, group=group)
    reports = cast("list[tuple[ProcessIdentity, dict[str, str]]]", found)
    record_identities(
        {dist.get_global_rank(group, r): ident for r, (ident, _) in enumerate(reports)}
    )
    keys = sorted({k for _, rank_facts in reports for k in rank_facts})
    differing = []
    for key in keys:
        values = [rank_facts.get(key, "<missing>") for _, rank_facts in reports]
        if len(set(values)) > 1:
            by_rank = "; ".join(
                f"rank {dist.get_global_rank(group, r)}: {_short(v)}" for r, v in enumerate(values)
            )
            differing.append(f"  {key}: {by_rank}")
    if differing:
        raise RankMismatchError(
            f"{what}: the ranks of group {group_name(group)} disagree on\n"
            + "\n".join(differing)
            + "\nEvery rank must build the same model and call the same wrapping functions "
            "with the same arguments in the same order; fix the rank(s) that differ"
        )
