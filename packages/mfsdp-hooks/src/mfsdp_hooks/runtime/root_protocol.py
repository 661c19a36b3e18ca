"""What a unit and a parameter group may ask of their root: a leaf module, so that
``unit``, ``param_group`` and ``root`` never import each other in a circle.

The root (``root.FSDPRoot``) is built lazily by the first unit to run forward; the unit gets
the function that builds it (``make_root``) from ``fully_shard``, which is the one module
that knows both sides.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, TypeVar

from mfsdp_collectives import CommStreams

U = TypeVar("U")
G = TypeVar("G", contravariant=True)

__all__ = ["UnitRoot"]


class UnitRoot(Protocol[U, G]):
    """What a unit asks of its root: the order of units, prefetch targets, the reduction
    queue. ``U`` is the unit type, ``G`` the parameter group."""

    @property
    def root_unit(self) -> U: ...

    @property
    def streams(self) -> CommStreams: ...

    @property
    def units(self) -> Sequence[U]: ...

    def pre_root_forward(self) -> None: ...

    def record_forward(self, unit: U) -> None: ...

    def forward_prefetch_targets(self, unit: U) -> Sequence[U]: ...

    def backward_prefetch_targets(self, unit: U) -> Sequence[U]: ...

    def begin_backward(self) -> None: ...

    def reap_finished_reductions(self) -> None: ...

    def should_reduce(self, group: G) -> bool: ...

    def settle_reduction(self, group: G) -> None: ...

    def reduce(self, group: G) -> None: ...

    def start_grad_sync(self) -> None: ...

    def finish_grad_sync(self) -> None: ...
