"""Where a unit's FSDP2 communication hooks change: checked, then given to its groups."""

from __future__ import annotations

import dataclasses
from typing import Any

from mfsdp_hooks.config.comm_hooks import CommHooks, check_comm_hooks
from mfsdp_hooks.runtime.training_state import TrainingState
from mfsdp_hooks.runtime.unit import FSDPUnit

__all__ = ["checked_comm_hooks", "set_comm_hooks"]


def checked_comm_hooks(unit: FSDPUnit, **change: Any) -> CommHooks:
    """``unit``'s communication hooks with ``change`` applied, checked as ``set_comm_hooks``
    checks them (it raises where they would be refused) but not installed: a caller changing
    many units checks them all before it changes any."""
    if unit.state is not TrainingState.IDLE:
        raise RuntimeError(
            f"FSDP unit {unit.name}: communication hooks can be set only between "
            f"iterations, not during {unit.state.value}"
        )
    hooks = dataclasses.replace(unit.comm_hooks, **change)
    options = unit.options
    check_comm_hooks(hooks, unit.name, strategy=options.strategy, topology=options.topology)
    return hooks


def set_comm_hooks(unit: FSDPUnit, **change: Any) -> None:
    """Change some of ``unit``'s communication hooks (``config.comm_hooks``): outside forward
    and backward only, refused where the engine would not honour them. Each parameter group
    gathers through the all-gather comm; its reducer takes the rest."""
    hooks = checked_comm_hooks(unit, **change)
    for group in unit.groups:
        group.all_gather_comm = hooks.all_gather
        if group.reducer is not None:
            group.reducer.use_comm_hooks(hooks)
    unit.comm_hooks = hooks
