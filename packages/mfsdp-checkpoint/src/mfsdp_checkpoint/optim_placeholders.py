"""Optimizer state for parameters that have none yet, made without touching the optimizer.

A fresh optimizer has no state for ``dcp.load`` to fill (the seed README's load snippet would
silently drop the checkpoint's moments). Taking a real step to create it (what the reference
and ``torch.distributed.checkpoint.state_dict`` do) moves step counters and can move weights,
so a *scratch* copy of the optimizer steps on zero-filled stand-ins instead.

Each placeholder tensor remembers its version counter. DCP writes into tensors in place, so a
placeholder whose counter moved was loaded from the checkpoint; one that did not is dropped at
``load_state_dict`` and its parameter stays fresh.
"""

from __future__ import annotations

import copy
import weakref
from collections import OrderedDict, defaultdict
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from mfsdp_hooks import local_tensor

_LIVE: weakref.WeakValueDictionary[int, torch.Tensor] = weakref.WeakValueDictionary()


def version_of(tensor: torch.Tensor) -> int:
    """The in-place write counter DCP bumps when it loads into ``tensor``."""
    local = local_tensor(tensor)
    return int(local._version)


def is_placeholder(value: Any) -> bool:
    """True for a tensor made here and still alive (used to prune keys a checkpoint lacks)."""
    return isinstance(value, torch.Tensor) and _LIVE.get(id(value)) is value


def _stand_in(param: nn.Parameter) -> torch.Tensor:
    with torch.no_grad():
        stand_in = torch.zeros_like(param)
    stand_in.requires_grad_(True)
    stand_in.grad = torch.zeros_like(stand_in)
    return stand_in


def make_placeholders(
    optimizer: torch.optim.Optimizer, params: list[nn.Parameter]
) -> list[dict[str, Any]]:
    """Zeroed state entries for ``params`` (in order), as the optimizer's own step makes them."""
    if not params:
        return []
    stand_ins = {id(p): _stand_in(p) for p in params}
    scratch = copy.copy(optimizer)  # Optimizer.__getstate__: defaults, state, param_groups
    scratch.state = defaultdict(dict)
    scratch.param_groups = [
        {**group, "params": [stand_ins[id(p)] for p in group["params"] if id(p) in stand_ins]}
        for group in optimizer.param_groups
    ]
    scratch.param_groups = [g for g in scratch.param_groups if g["params"]]
    scratch._optimizer_step_pre_hooks = OrderedDict()
    scratch._optimizer_step_post_hooks = OrderedDict()
    try:
        scratch.step()
    except Exception as error:
        raise RuntimeError(
            f"cannot create state placeholders for {type(optimizer).__name__} without a step "
            f"({error}); take one real optimizer step before calling state_dict() to load into it"
        ) from error
    entries = []
    with torch.no_grad():
        for param in params:
            entry = dict(scratch.state.get(stand_ins[id(param)], {}))
            for value in entry.values():
                if isinstance(value, torch.Tensor):
                    value.zero_()
                    _LIVE[id(value)] = value
            entries.append(entry)
    return entries


class PlaceholderLedger:
    """The placeholders handed out by the latest ``state_dict()`` call, by parameter name."""

    def __init__(self) -> None:
        self._entries: dict[str, list[tuple[weakref.ref[torch.Tensor], int]]] = {}

    def record(self, name: str, entry: Mapping[str, Any]) -> None:
        self._entries[name] = [
            (weakref.ref(v), version_of(v)) for v in entry.values() if isinstance(v, torch.Tensor)
        ]

    def clear(self) -> None:
        self._entries.clear()

    def never_loaded(self, name: str, entry: Mapping[str, Any]) -> bool:
        """True when ``entry`` is exactly a placeholder of ours that nothing wrote into."""
        recorded = self._entries.get(name)
        tensors = [v for v in entry.values() if isinstance(v, torch.Tensor)]
        if recorded is None or len(tensors) != len(recorded):
            return False
        return all(
            ref() is tensor and version_of(tensor) == version
            for tensor, (ref, version) in zip(tensors, recorded, strict=True)
        )
