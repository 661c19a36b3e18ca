"""Compare a state dict with a DCP checkpoint's metadata before loading anything.

DCP stops at the first missing key and says nothing about the rest. Loading the wrong model is
easier to fix with the whole picture, so this collects every missing key, every unexpected key
(of the sections being loaded) and every shape mismatch into one ``StateDictMismatchError``.
It reads only metadata: no collectives, identical on every rank.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.distributed.checkpoint._nested_dict import flatten_state_dict
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    Metadata,
    TensorStorageMetadata,
)

from mfsdp_checkpoint.errors import StateDictMismatchError
from mfsdp_checkpoint.optim_placeholders import is_placeholder

_SHOWN = 20

ObjPath = tuple[str | int, ...]


@dataclass
class Comparison:
    missing: list[str] = field(default_factory=list)
    unexpected: list[str] = field(default_factory=list)
    mismatched: list[str] = field(default_factory=list)
    prunable: list[ObjPath] = field(default_factory=list)
    """Optimizer placeholders the checkpoint has no value for: dropped, the state stays fresh."""

    def message(self, where: str) -> str:
        listed = summarize(
            [
                ("missing from the checkpoint", self.missing),
                ("unexpected (in the checkpoint, not in the state dict)", self.unexpected),
                ("shape mismatches", self.mismatched),
            ]
        )
        return f"checkpoint {where} does not match the state dict (a different model?): {listed}"


def summarize(labelled: list[tuple[str, list[str]]]) -> str:
    """``"<count> <label>: <the first keys> ..."`` of each non-empty list, joined by ``"; "``."""
    return "; ".join(
        f"{len(keys)} {label}: " + ", ".join(keys[:_SHOWN]) + (" ..." if len(keys) > _SHOWN else "")
        for label, keys in labelled
        if keys
    )


def _section(key: str, metadata: Metadata) -> str:
    mappings = metadata.planner_data if isinstance(metadata.planner_data, Mapping) else {}
    path = mappings.get(key)
    if path:
        return str(path[0])
    return key.split(".", 1)[0]


def check(
    state_dict: Mapping[str, Any], metadata: Metadata, where: str, strict: bool, sections: set[str]
) -> Comparison:
    """Everything that keeps ``state_dict`` from loading from a checkpoint with ``metadata``;
    raises ``StateDictMismatchError`` unless it can load (``strict``: fully). ``sections``: the
    top-level sections being loaded (a flat ``state_dict``'s keys no longer tell them)."""
    flat, mappings = flatten_state_dict(dict(state_dict))
    saved = metadata.state_dict_metadata
    result = Comparison()
    for key, value in flat.items():
        entry = saved.get(key)
        if entry is None:
            if is_placeholder(value):
                result.prunable.append(tuple(mappings[key]))
            else:
                result.missing.append(key)
            continue
        is_tensor = isinstance(value, torch.Tensor)
        if isinstance(entry, TensorStorageMetadata):
            if not is_tensor:
                result.mismatched.append(f"{key} (checkpoint tensor, state dict object)")
            elif tuple(entry.size) != tuple(value.shape):
                result.mismatched.append(
                    f"{key} (checkpoint {tuple(entry.size)}, state dict {tuple(value.shape)})"
                )
        elif isinstance(entry, BytesStorageMetadata) and is_tensor:
            result.mismatched.append(f"{key} (checkpoint object, state dict tensor)")
    result.unexpected = sorted(
        key for key in saved if key not in flat and _section(key, metadata) in sections
    )
    if result.mismatched or (strict and (result.missing or result.unexpected)):
        raise StateDictMismatchError(result.message(where))
    return result


def prune(state_dict: dict[str, Any], paths: list[ObjPath]) -> None:
    """Remove the values at ``paths``, and a per-parameter entry that this leaves empty."""
    for path in paths:
        parents: list[Any] = [state_dict]
        for part in path[:-1]:
            parents.append(parents[-1][part])
        container = parents[-1]
        if isinstance(container, dict):
            container.pop(path[-1], None)
            if not container and len(parents) >= 2 and isinstance(parents[-2], dict):
                parents[-2].pop(path[-2], None)
