"""Stable, readable names for process groups, for the tracer and errors: c10d's own
``group_name`` is an opaque counter that differs between runs, so a group is named by its
registered role ("dp_shard"), its DeviceMesh dim, or its member ranks ("pg[0-3]").
"""

from __future__ import annotations

import threading

import torch.distributed as dist

__all__ = ["group_name", "register_group_name"]

_MESH_DESC_PREFIX = "mesh_"

_lock = threading.Lock()
_registered: dict[str, str] = {}  # c10d group_name -> readable name
_cache: dict[str, str] = {}


def register_group_name(group: dist.ProcessGroup, name: str, *, replace: bool = True) -> None:
    """Give ``group`` a readable ``name`` (the latest registration wins unless ``replace`` is
    False: then a group that already has a role keeps it)."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"name must be a non-empty string, got {name!r}")
    with _lock:
        if replace or group.group_name not in _registered:
            _registered[group.group_name] = name


def group_name(group: dist.ProcessGroup) -> str:
    """Readable name of ``group``: its registered role, mesh dim, or member ranks."""
    key = group.group_name
    with _lock:
        name = _registered.get(key) or _cache.get(key)
    if name is not None:
        return name
    name = _derive_name(group)
    with _lock:
        _cache[key] = name
    return name


def _derive_name(group: dist.ProcessGroup) -> str:
    desc = getattr(group, "group_desc", "") or ""
    if desc.startswith(_MESH_DESC_PREFIX) and len(desc) > len(_MESH_DESC_PREFIX):
        return desc[len(_MESH_DESC_PREFIX) :]
    return "pg[" + _format_ranks(dist.get_process_group_ranks(group)) + "]"


def _format_ranks(ranks: list[int]) -> str:
    """``[0, 1, 2, 3]`` -> ``"0-3"``; ``[0, 2]`` -> ``"0,2"`` (short for big worlds)."""
    if len(ranks) > 2 and ranks == list(range(ranks[0], ranks[-1] + 1)):
        return f"{ranks[0]}-{ranks[-1]}"
    return ",".join(str(r) for r in ranks)
