"""The completion marker of a checkpoint directory, and telling complete from partial (how a
save writes them: the package README, "Atomic saves, checked loads").

A directory is *complete* when it has the marker, *partial* when it has the in-progress
sentinel, is named ``*.partial`` (a save is committed by its rename, so a staging directory
never loads, marker or not), or has neither marker nor DCP metadata, and *foreign* when it is
a plain DCP checkpoint written by someone else (accepted, but without integrity checks).
"""

from __future__ import annotations

import json
import os
import warnings
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from mfsdp_checkpoint.errors import (
    CheckpointNotFoundError,
    CorruptCheckpointError,
    IncompleteCheckpointError,
)

MARKER = "mfsdp_checkpoint.json"
IN_PROGRESS = ".mfsdp_save_in_progress"
DCP_METADATA = ".metadata"
FORMAT = "mfsdp-checkpoint"
FORMAT_VERSION = 1
_BLOCK = 8 << 20


def partial_path(path: Path) -> Path:
    """Where a save of ``path`` is staged until it is complete."""
    return path.with_name(path.name + ".partial")


def previous_path(path: Path) -> Path:
    """Where the replaced checkpoint sits for the instant an overwrite swaps directories."""
    return path.with_name(path.name + ".old")


def reserved_suffix(path: Path) -> str | None:
    """The suffix of ``path`` that a save uses for its own directories, if it has one."""
    for suffix in (".partial", ".old"):
        if path.name.endswith(suffix):
            return suffix
    return None


def resolve_interrupted_swap(path: Path) -> Path:
    """Where the checkpoint of ``path`` is: ``path`` itself, or the checkpoint an overwrite
    had moved aside when it was killed between its two renames (``path`` then is missing)."""
    old = previous_path(path)
    if path.exists() or not (old / MARKER).is_file() or (old / IN_PROGRESS).exists():
        return path
    warnings.warn(
        f"{path} is missing because a save was killed while replacing it; loading the "
        f"complete checkpoint it was replacing, {old}. The next save to {path} removes it",
        stacklevel=3,
    )
    return old


def crc32_of(path: Path) -> int:
    crc = 0
    with path.open("rb") as handle:
        while block := handle.read(_BLOCK):
            crc = zlib.crc32(block, crc)
    return crc


def fsync_dir(path: Path) -> None:
    """Make a rename or a new file in ``path`` durable (a no-op where directories can't sync)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def write_json_durably(path: Path, content: dict[str, Any]) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with tmp.open("w") as handle:
        json.dump(content, handle, indent=1, sort_keys=True)
        handle.flush()
        os.fsync(handle.fileno())
    tmp.replace(path)
    fsync_dir(path.parent)


def write_in_progress(staging: Path) -> None:
    write_json_durably(staging / IN_PROGRESS, {"pid": os.getpid(), "format": FORMAT})


def write_marker(staging: Path, world_size: int, files: dict[str, dict[str, int]]) -> None:
    write_json_durably(
        staging / MARKER,
        {
            "format": FORMAT,
            "version": FORMAT_VERSION,
            "world_size": world_size,
            "torch": torch.__version__,
            "files": files,
        },
    )
    (staging / IN_PROGRESS).unlink(missing_ok=True)
    fsync_dir(staging)


@dataclass(frozen=True)
class DirectoryInfo:
    path: Path
    marker: dict[str, Any] | None
    """The completion marker; None for a plain DCP directory written without this layer."""


def inspect_directory(path: Path) -> DirectoryInfo:
    """Classify ``path``; raise the error a load of it must raise, or return its marker."""
    if not path.exists():
        hints = []
        if partial_path(path).exists():
            hints.append(
                f"an unfinished save of it is at {partial_path(path)} (the process saving it "
                "stopped before the save completed)"
            )
        if (previous_path(path) / MARKER).exists():
            hints.append(
                f"the checkpoint it replaced is intact at {previous_path(path)} (a save was "
                "interrupted while swapping directories)"
            )
        raise CheckpointNotFoundError(
            f"no checkpoint at {path}" + ("; " + "; ".join(hints) if hints else "")
        )
    if not path.is_dir():
        raise CheckpointNotFoundError(
            f"{path} is a file, not a DCP checkpoint directory; load single files with "
            "mfsdp_checkpoint.load_full_state_dict or convert them with mfsdp-checkpoint convert"
        )
    if (path / IN_PROGRESS).exists():
        raise IncompleteCheckpointError(
            f"{path} is an incomplete checkpoint: its save never finished (it has no completion "
            f"marker {MARKER}); refusing to load it. Load the previous checkpoint instead"
        )
    if path.name.endswith(".partial"):  # committed by the rename, not by the marker
        raise IncompleteCheckpointError(
            f"{path} is an incomplete checkpoint: it is the staging directory of a save that "
            "never finished (the save was killed before its final rename, even if every file "
            f"is written); refusing to load it. Load {path.with_suffix('')} instead"
        )
    marker_file = path / MARKER
    if marker_file.exists():
        try:
            marker = json.loads(marker_file.read_text())
        except (OSError, ValueError) as error:
            raise CorruptCheckpointError(f"{marker_file} is unreadable: {error}") from None
        if not isinstance(marker, dict) or marker.get("format") != FORMAT:
            raise CorruptCheckpointError(f"{marker_file} is not an {FORMAT} completion marker")
        return DirectoryInfo(path, marker)
    if not (path / DCP_METADATA).exists():
        raise IncompleteCheckpointError(
            f"{path} has neither a completion marker ({MARKER}) nor DCP metadata "
            f"({DCP_METADATA}): it is not a finished checkpoint"
        )
    return DirectoryInfo(path, None)


def verify_files(info: DirectoryInfo, share: tuple[int, int], checksums: bool) -> None:
    """Check the files the marker lists: all sizes here, checksums of this rank's share."""
    if info.marker is None:
        return
    files: dict[str, dict[str, int]] = info.marker.get("files", {})
    rank, world = share
    for number, (name, record) in enumerate(sorted(files.items())):
        file = info.path / name
        if not file.exists():
            raise CorruptCheckpointError(f"{info.path}: file {name} listed by {MARKER} is missing")
        size = file.stat().st_size
        if size != record["bytes"]:
            raise CorruptCheckpointError(
                f"{info.path}: file {name} has {size} bytes, its save wrote {record['bytes']} "
                "(truncated or overwritten)"
            )
        recorded = record.get("crc32", -1)
        if recorded < 0 or not checksums or number % world != rank:
            continue
        if crc32_of(file) != recorded:
            raise CorruptCheckpointError(
                f"{info.path}: file {name} is corrupted (CRC32 differs from the one recorded "
                "when it was saved); restore that file from a copy or load another checkpoint"
            )
