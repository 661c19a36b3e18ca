"""The order the units ran forward in, and the prefetch targets it implies.

The first iteration records the order (the same on every rank: collectives follow it); its
backward fixes it, and from then on each unit's forward prefetches the next
``prefetch_depth`` units and its backward the previous ones (never the root, whose weights
backward keeps). Lists a user set with ``set_modules_to_forward_prefetch`` /
``set_modules_to_backward_prefetch`` win over the recorded order.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Generic, TypeVar

from mfsdp_hooks.config.unit_options import RootOptions

__all__ = ["ExecutionOrder"]


U = TypeVar("U")


class ExecutionOrder(Generic[U]):
    """Records the first iteration's forward order; afterwards answers prefetch targets
    (``U``, the unit type, is generic so this module does not import the unit)."""

    def __init__(
        self, root_unit: U, root_options: Callable[[], RootOptions], *, numel_of: Callable[[U], int]
    ) -> None:
        """``root_options`` reads the root's options where they live: ``prefetch_depth``
        units ahead, or with ``prefetch_numel`` the next (previous) units while their
        ``numel_of`` sums to at most it; ``coalesce_prefetch`` gathers a window's targets
        together, once it has drained (``gather_ahead``)."""
        self._root_unit = root_unit
        self._root_options = root_options
        self._numel_of = numel_of
        self._order: list[U] = []
        self.final = False
        self._next: dict[int, list[U]] = {}
        self._previous: dict[int, list[U]] = {}

    @property
    def coalesce(self) -> bool:
        return self._root_options().coalesce_prefetch

    def record(self, unit: U) -> None:
        """A unit's forward began (recorded once, until the order is final)."""
        if not self.final and all(u is not unit for u in self._order):
            self._order.append(unit)

    def finalize(self) -> None:
        """The first backward ended: fix the prefetch targets from the recorded order."""
        if self.final:
            return
        order, depth = self._order, self._root_options().prefetch_depth
        self._next = {
            id(u): self._window(order[i + 1 : i + 1 + depth], order[i + 1 :])
            for i, u in enumerate(order)
        }
        self._previous = {
            id(u): self._window(
                self._without_root(order[max(i - depth, 0) : i]), self._without_root(order[:i])
            )
            for i, u in enumerate(order)
        }
        self.final = True

    def _without_root(self, units: list[U]) -> list[U]:
        """``units`` nearest first, without the root (backward keeps its weights)."""
        return [u for u in reversed(units) if u is not self._root_unit]

    def _window(self, by_depth: list[U], ahead: list[U]) -> list[U]:
        """``by_depth``, or with a numel limit the first of ``ahead`` that fit in it."""
        limit = self._root_options().prefetch_numel
        if limit is None:
            return by_depth
        taken, total = [], 0
        for unit in ahead:
            total += self._numel_of(unit)
            if total > limit:
                break
            taken.append(unit)
        return taken

    def forward_targets(self, unit: U, override: list[U] | None) -> list[U]:
        """Units to gather while ``unit`` computes forward."""
        if override is not None:
            return override
        return self._next.get(id(unit), []) if self.final else []

    def backward_targets(self, unit: U, override: list[U] | None) -> list[U]:
        """Units to gather while ``unit`` computes backward."""
        if override is not None:
            return override
        return self._previous.get(id(unit), []) if self.final else []
