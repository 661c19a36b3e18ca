"""Which modules drive a unit's forward, and whether a pass over them is under way.

A unit is usually one module. ``fully_shard([a, b])`` makes one unit over several (FSDP2's
grouping, e.g. a tied embedding and output head): the first member's pre-forward gathers
the weights, the last member's post-forward may reshard them, and a member that does not run
in a pass has its group ended by the root's post-forward.
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn


class MemberForwards:
    """The members of one unit and those whose forward has not finished in this pass.

    States: idle (no member pending) and in a pass (some pending). ``begin`` moves idle ->
    in a pass; ``finish`` and ``abandon`` move back once nothing is pending.
    """

    def __init__(self, members: Sequence[nn.Module]) -> None:
        self.members = tuple(members)
        self._pending: set[int] = set()

    def begin(self, module: nn.Module, *, alone: bool = False) -> bool:
        """At a member's pre-forward: True when it starts the unit's forward (a single
        member always does; of several, the first one to run). ``alone``: the member runs
        by itself, outside its root's forward (a chunked loss calling the head on pieces of
        the output): its own forward is the whole pass."""
        if len(self.members) == 1:
            return True
        if self._pending:
            return False
        self._pending = {id(module)} if alone else {id(m) for m in self.members}
        return True

    def finish(self, module: nn.Module) -> bool:
        """At a member's post-forward: True when it ends the unit's forward."""
        if len(self.members) == 1:
            return True
        self._pending.discard(id(module))
        return not self._pending

    def abandon(self) -> bool:
        """End a pass some member skipped; True when one was under way."""
        under_way = bool(self._pending)
        self._pending.clear()
        return under_way


class ModuleGroup(nn.Module):
    """The modules of ``fully_shard([a, b, ...])`` as one unit's scope. It lives outside the
    user's tree (the members stay where they are) and never runs: the members' forwards
    drive the unit."""

    def __init__(self, members: Sequence[nn.Module]) -> None:
        super().__init__()
        for index, member in enumerate(members):
            self.add_module(str(index), member)


def unit_members(module: object) -> list[nn.Module]:
    """The modules one unit covers: ``module`` itself, or each of a list of them."""
    given: list[object] = list(module) if isinstance(module, (list, tuple)) else [module]
    if not given:
        raise ValueError("module: fully_shard([]) got no modules; pass at least one")
    members: list[nn.Module] = []
    for index, member in enumerate(given):
        if not isinstance(member, nn.Module):
            where = f"module[{index}]" if isinstance(module, (list, tuple)) else "module"
            raise TypeError(f"{where} must be an nn.Module, got {type(member).__name__}")
        members.append(member)
    if len({id(m) for m in members}) != len(members):
        raise ValueError("module: the list names one module twice; give each once")
    for member in members:
        inner = [m for m in members if m is not member and _contains(member, m)]
        if inner:
            raise ValueError(
                f"module: {type(inner[0]).__name__} is inside {type(member).__name__}; "
                "give fully_shard([...]) modules none of which contains another"
            )
    return members


def _contains(outer: nn.Module, inner: nn.Module) -> bool:
    return any(m is inner for m in outer.modules())
