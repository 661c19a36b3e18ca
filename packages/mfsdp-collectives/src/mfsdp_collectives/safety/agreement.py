"""Check at wrap time that every rank is about to do the same thing.

Collectives pair up by order: a rank that wraps another model or strategy meets different
collectives on its peers, and the job hangs or trains on garbage. One small exchange before a
wrap's first collective turns that into an error on every rank naming what differs; it also
tells each rank its peers' processes (``liveness``).

At a thousand ranks an object all-gather per unit is most of a wrap's time, so each rank
first sends a digest of its facts (and whether it knows this group's processes yet) in one
fixed-size all-gather; only when those differ do the ranks exchange the facts themselves.
Every rank sees the same digests and takes the same branch, so the collectives stay paired.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Mapping, Sequence
from typing import cast

import torch
import torch.distributed as dist

from ..core._compat import all_gather_single, backend_name
from ..core.fake import real_tensors
from ..core.naming import group_name
from .liveness import ProcessIdentity, identities_known, naming_dead_peers, record_identities

__all__ = ["RankFacts", "RankMismatchError", "check_ranks_agree"]

_SHOWN_VALUE_CHARS = 160
_DIGEST_BYTES = 16  # blake2b: a collision of differing facts is out of reach at 128 bits

RankFacts = tuple[int, Mapping[str, str]]
"""One rank's facts as ``check_ranks_agree`` gathered them: (global rank, facts)."""


class RankMismatchError(ValueError):
    """The ranks of a group were asked to do different things (raised on every rank)."""


def _short(value: str) -> str:
    return value if len(value) <= _SHOWN_VALUE_CHARS else value[:_SHOWN_VALUE_CHARS] + "..."


def _ranks(ranks: Sequence[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ", ".join(map(str, ranks))


def _camps(values: Sequence[object], ranks: Sequence[int]) -> list[list[int]]:
    """The ranks grouped by equal value, in order of each camp's first rank."""
    camps: dict[object, list[int]] = {}
    for value, rank in zip(values, ranks, strict=True):
        camps.setdefault(value, []).append(rank)
    return list(camps.values())


def _by_camp(values: Sequence[str], ranks: Sequence[int]) -> str:
    """``"rank 0: a; ranks 1, 2: b"``: each camp of equal values and its value."""
    return "; ".join(
        f"{_ranks(camp)}: {_short(values[ranks.index(camp[0])])}" for camp in _camps(values, ranks)
    )


def _who_differs(reports: Sequence[RankFacts]) -> str:
    """Which ranks differ: from the largest camp of ranks with identical facts (on a tie,
    the camp of the group's first rank), so one odd rank out of eight is named as such."""
    keyed = [tuple(sorted(facts.items())) for _, facts in reports]
    camps = _camps(keyed, [rank for rank, _ in reports])
    main = max(camps, key=len)  # max keeps the first of equal sizes: the first rank's camp
    others = sorted(rank for camp in camps if camp is not main for rank in camp)
    verb = "differs" if len(others) == 1 else "differ"
    tie = " (as many ranks on each side: either may be the one to fix)" * (
        len(camps) == 2 and len(others) == len(main)
    )
    return f"{_ranks(others)} {verb} from {_ranks(main)}{tie}"


def _first_difference(key: str, items: Sequence[Sequence[str]], ranks: Sequence[int]) -> str:
    """The first item of ``key``'s itemised form (``details``) that differs, per rank."""
    length = max(len(rank_items) for rank_items in items)
    for index in range(length):
        values = [
            rank_items[index] if index < len(rank_items) else "<none>" for rank_items in items
        ]
        if len(set(values)) > 1:
            return f"    first difference in {key}, item {index}: {_by_camp(values, ranks)}"
    return f"    the items of {key} are equal but ordered or counted differently"


def _differences(
    reports: Sequence[RankFacts], details: Sequence[Mapping[str, Sequence[str]]]
) -> list[str]:
    ranks = [rank for rank, _ in reports]
    keys = sorted({k for _, rank_facts in reports for k in rank_facts})
    lines = []
    for key in keys:
        values = [rank_facts.get(key, "<missing>") for _, rank_facts in reports]
        if len(set(values)) == 1:
            continue
        lines.append(f"  {key}: {_by_camp(values, ranks)}")
        if all(key in rank_details for rank_details in details):
            lines.append(_first_difference(key, [d[key] for d in details], ranks))
    return lines


def _facts_digest(facts: Mapping[str, str]) -> bytes:
    """Equal bytes for equal facts in every process (never ``hash()``, salted per process):
    blake2b of the facts as JSON with sorted keys. A value that is not JSON counts by its
    ``repr``; should that differ between equal values, the facts are compared in full."""
    text = json.dumps(dict(facts), sort_keys=True, ensure_ascii=False, default=repr)
    return hashlib.blake2b(text.encode("utf-8"), digest_size=_DIGEST_BYTES).digest()


def _exchange_device(group: dist.ProcessGroup) -> torch.device:
    """Where the digests travel: CPU where the backend carries CPU tensors (gloo, torch's
    fake group, a "cpu:gloo,cuda:nccl" pair), else this rank's accelerator (nccl)."""
    name = backend_name(group)
    if "cpu:" in name or "cpu" in dist.Backend.backend_capability.get(name, ["cpu"]):
        return torch.device("cpu")
    accelerator = torch.accelerator.current_accelerator()
    if accelerator is None:
        return torch.device("cpu")
    return torch.device(accelerator.type, torch.accelerator.current_device_index())


def _digests_agree(group: dist.ProcessGroup, facts: Mapping[str, str], what: str) -> bool:
    """Whether every rank has facts of the same digest and knows the processes of ``group``
    already (one all-gather of a few bytes per rank, whatever the facts weigh). The answer
    is read off the gathered bytes, equal on every rank: every rank returns the same."""
    sent = [0 if identities_known(group) else 1, *_facts_digest(facts)]
    size = dist.get_world_size(group)
    # Real tensors: under FakeTensorMode (a planning run) the bytes must be compared.
    with naming_dead_peers(f"the agreement check of {what}", group), real_tensors():
        device = _exchange_device(group)
        every = torch.empty(size * len(sent), dtype=torch.uint8, device=device)
        mine = torch.tensor(sent, dtype=torch.uint8, device=device)
        all_gather_single(every, mine, group, async_op=False)
        rows = every.view(size, len(sent))
        return bool((rows == rows[0]).all()) and int(rows[0, 0]) == 0


def check_ranks_agree(
    group: dist.ProcessGroup,
    facts: Mapping[str, str],
    *,
    what: str,
    details: Mapping[str, Sequence[str]] | None = None,
    explain: Callable[[Sequence[RankFacts]], str | None] | None = None,
) -> None:
    """Raise ``RankMismatchError`` on every rank unless all ranks of ``group`` pass equal
    ``facts`` (collective over ``group``).

    ``what`` names the call checked ("fully_shard(Block)"); the error lists each differing
    fact with every rank's value. ``details`` (exchanged, not compared) itemises a fact that
    is a digest, so the error names its first differing item. ``explain`` turns every rank's
    facts into a sentence saying what the difference means.
    """
    if _digests_agree(group, facts, what):
        return
    mine = (ProcessIdentity.of_this_process(), dict(facts), dict(details or {}))
    found: list[object] = [None] * dist.get_world_size(group)
    with naming_dead_peers(f"the agreement check of {what}", group), real_tensors():
        dist.all_gather_object(found, mine, group=group)
    gathered = cast("list[tuple[ProcessIdentity, dict[str, str], dict[str, list[str]]]]", found)
    ranks = [dist.get_global_rank(group, r) for r in range(len(gathered))]
    record_identities({ranks[r]: ident for r, (ident, _, _) in enumerate(gathered)}, group)
    reports: list[RankFacts] = [(ranks[r], f) for r, (_, f, _) in enumerate(gathered)]
    differing = _differences(reports, [d for _, _, d in gathered])
    if not differing:
        return
    meaning = explain(reports) if explain is not None else None
    raise RankMismatchError(
        f"{what}: the ranks of group {group_name(group)} disagree on\n"
        + "\n".join(differing)
        + f"\n{_who_differs(reports)}"
        + (f"\n{meaning}" if meaning else "")
        + "\nEvery rank must build the same model and call the same wrapping functions "
        "with the same arguments in the same order; fix the rank(s) that differ"
    )
