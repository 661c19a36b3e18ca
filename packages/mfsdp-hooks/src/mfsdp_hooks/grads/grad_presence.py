"""Which parameters got a gradient on some rank: torch's ``None`` for those that got none.

Under DDP and FSDP2 a parameter no backward reached keeps ``.grad`` None, so torch's
optimizers skip it. A rank alone cannot tell: a parameter its data skipped may have a
gradient on another rank (an expert that got tokens there), and then every rank must take the
reduced gradient, or the ranks' weights drift apart. So each reducer notes, per parameter,
whether this rank collected a gradient since the last agreement (``Presence``), and where the
backward waits for its reductions ``agree_on_presence`` sums those flags over the ranks in one
small all-reduce per set of groups (cost: ``docs/differences-from-fsdp2.md``). A rank with
nothing to drop waits for it without reading it back (no device-to-host copy on the hot path).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from mfsdp_collectives import FSDPTopology, ReduceSpec, all_reduce_

__all__ = ["Presence", "agree_on_presence"]

_SUM = ReduceSpec(average=False)


@dataclass
class Presence:
    """One reducer's gradients since the last agreement, per parameter."""

    had: list[bool]
    """This rank collected a gradient (in any reduction of the window)."""
    kept: list[bool]
    """The parameter held a gradient before the window's first reduction (torch adds to it)."""

    def add(self, had: Sequence[bool]) -> None:
        """Another reduction in the same window (a ``no_sync`` part, the replica hop)."""
        self.had = [a or b for a, b in zip(self.had, had, strict=True)]

    @property
    def may_drop(self) -> bool:
        """Some parameter got no gradient here and held none: the agreement decides it."""
        return any(not had and not kept for had, kept in zip(self.had, self.kept, strict=True))


class Agreeing(Protocol):
    """A reducer as the agreement sees it (``GradReducer``)."""

    presence: Presence | None

    @property
    def topology(self) -> FSDPTopology: ...

    def drop_absent(self, agreed: Sequence[bool]) -> None: ...


def agree_on_presence(reducers: Sequence[Agreeing]) -> None:
    """Agree with the other ranks which parameters of ``reducers`` (those whose reductions
    landed: the caller drained them) got a gradient anywhere, and drop the rest.

    Every rank calls it at the same point with its reducers in the same order (reductions pair
    up by order), so the all-reduces pair up too: one per distinct (shard, outer) groups.
    """
    by_groups: dict[tuple[int, int], list[Agreeing]] = {}
    for reducer in reducers:
        if reducer.presence is not None:
            topology = reducer.topology
            key = (id(topology.shard_group), id(topology.outer_group))
            by_groups.setdefault(key, []).append(reducer)
    issued = []
    for members in by_groups.values():
        topology = members[0].topology
        flags = [had for reducer in members for had in _presence(reducer).had]
        summed = torch.tensor(flags, dtype=torch.float32, device=topology.device)
        handle = all_reduce_(
            summed,
            topology.shard_group,
            spec=_SUM,
            outer_group=topology.outer_group,
            record_as="grad_presence",
        )
        issued.append((members, summed, handle))
    for members, summed, handle in issued:
        handle.wait()
        if not any(_presence(reducer).may_drop for reducer in members):
            for reducer in members:  # nothing to drop here: no need to read the sums back
                reducer.presence = None
            continue
        agreed: list[bool] = (summed > 0).tolist()
        offset = 0
        for reducer in members:
            count = len(_presence(reducer).had)
            reducer.drop_absent(agreed[offset : offset + count])
            offset += count


def _presence(reducer: Agreeing) -> Presence:
    presence = reducer.presence
    assert presence is not None
    return presence
