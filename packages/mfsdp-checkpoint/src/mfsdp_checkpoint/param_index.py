"""Which distributed parameter every state-dict name of a model refers to.

The engine swaps a unit's registered parameters between the sharded "dist params" (outside
forward) and the unsharded compute parameters (inside), and tied weights appear under several
names. This index resolves any of those names to one ``ParamRef`` (group, index, dist param),
built once from ``named_parameters`` with no communication.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from torch import nn

from mfsdp_checkpoint.chunks import RowChunk, group_chunks
from mfsdp_hooks import ParameterGroup, dist_param_of, locate


@dataclass(frozen=True)
class ParamRef:
    """One distributed parameter: its group, its index in the group and its canonical name."""

    fqn: str
    """First name of the parameter in ``named_parameters()`` order (tied aliases come later)."""
    group: ParameterGroup
    index: int
    param: nn.Parameter

    @property
    def chunk(self) -> RowChunk:
        return group_chunks(self.group)[self.index]


class ParamIndex:
    """Every name under ``module`` that resolves to a distributed parameter."""

    def __init__(self, module: nn.Module, groups: list[ParameterGroup] | None = None) -> None:
        """Index ``module``'s parameters; with ``groups``, only those owned by these groups."""
        self.by_name: dict[str, ParamRef] = {}
        self.aliases: dict[str, list[str]] = {}
        by_param: dict[int, ParamRef] = {}
        allowed = None if groups is None else {id(g) for g in groups}
        for name, param in module.named_parameters(remove_duplicate=False):
            location = locate(param)
            if location is None:
                continue
            group, dist_param = location.group, location.dist_param
            if allowed is not None and id(group) not in allowed:
                continue
            ref = by_param.get(id(dist_param))
            if ref is None:
                ref = ParamRef(name, group, location.index, dist_param)
                by_param[id(dist_param)] = ref
            self.by_name[name] = ref
            self.aliases.setdefault(ref.fqn, []).append(name)
        self._by_param = by_param

    def ref_of(self, param: nn.Parameter) -> ParamRef | None:
        dist_param = dist_param_of(param)
        return None if dist_param is None else self._by_param.get(id(dist_param))

    def refs(self) -> Iterator[ParamRef]:
        """Each distributed parameter once, in ``named_parameters`` order."""
        return iter(self._by_param.values())
