"""What a unit asks of its root: a leaf module, so that ``unit`` and ``root`` do not import
each other in a circle (``fully_shard`` hands a unit the ``make_root`` that builds it).
Beyond these few members a unit talks to the root's ``ExecutionOrder`` and ``GradSync``
directly: concrete classes an IDE follows.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, TypeVar

from mfsdp_collectives import CommStreams
from mfsdp_hooks.grads.grad_sync import GradSync
from mfsdp_hooks.runtime.execution_order import ExecutionOrder

U = TypeVar("U")

__all__ = ["UnitRoot"]


class UnitRoot(Protocol[U]):
    """What a unit asks of its root. ``U`` is the unit type."""

    @property
    def root_unit(self) -> U: ...

    @property
    def streams(self) -> CommStreams: ...

    @property
    def units(self) -> Sequence[U]: ...

    @property
    def order(self) -> ExecutionOrder[U]: ...

    @property
    def grad_sync(self) -> GradSync: ...

    def pre_root_forward(self) -> None: ...

    def begin_backward(self) -> None: ...
