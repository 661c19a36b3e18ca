"""Atomic DCP saves and checked loads (what is promised, and the kill-point tests: the package
README, "Atomic saves, checked loads" and "Reliability"). Every check ends in an agreement step,
so a failure is raised on every rank with the same message instead of leaving ranks waiting in
a collective.
"""

from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path
from typing import Any

import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.filesystem import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import LoadPlanner, SavePlanner
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

from mfsdp_checkpoint import _dist
from mfsdp_checkpoint.errors import CheckpointError, CorruptCheckpointError, StateDictMismatchError
from mfsdp_checkpoint.key_map import KeyPlan, plan_key_map
from mfsdp_checkpoint.marker import (
    IN_PROGRESS,
    MARKER,
    DirectoryInfo,
    crc32_of,
    fsync_dir,
    inspect_directory,
    partial_path,
    previous_path,
    reserved_suffix,
    resolve_interrupted_swap,
    verify_files,
    write_in_progress,
    write_marker,
)
from mfsdp_checkpoint.validate import Comparison, check, prune
from mfsdp_collectives import naming_dead_peers

PathLike = str | os.PathLike[str]
log = logging.getLogger("mfsdp_checkpoint")


def read_metadata(path: Path) -> Metadata:
    """The DCP metadata of ``path``, or a ``CorruptCheckpointError`` saying why not."""
    try:
        return FileSystemReader(path).read_metadata()
    except FileNotFoundError:
        raise CorruptCheckpointError(f"{path} has no DCP metadata file (.metadata)") from None
    except Exception as error:
        raise CorruptCheckpointError(
            f"{path}/.metadata cannot be read ({type(error).__name__}: {error}); the file is "
            "corrupted"
        ) from None


def _run_locally(problem_source: Any) -> _dist.Problem:
    try:
        problem_source()
    except CheckpointError as error:
        return _dist.problem_of(error)
    except OSError as error:
        return ("CheckpointError", f"{type(error).__name__}: {error}")
    return None


def _refuse_keys_no_rank_loads(
    unexpected: list[str], where: str, group: dist.ProcessGroup | None
) -> None:
    """Raise on every rank if a checkpoint key is unexpected on every rank."""
    everyone = [unexpected]
    if _dist.is_distributed():
        everyone = [[]] * _dist.world_size(group)
        dist.all_gather_object(everyone, unexpected, group=group)
    nobody = sorted(set.intersection(*(set(keys) for keys in everyone)))
    if nobody:
        raise StateDictMismatchError(Comparison(unexpected=nobody).message(where))


def check_target(path: PathLike) -> Path:
    """``path`` as a save target, refused before any I/O if a save could never publish it."""
    target = Path(path)
    suffix = reserved_suffix(target)
    if suffix is not None:
        raise ValueError(
            f"path: {target} ends in {suffix!r}, which saves reserve for their own staging and "
            "replaced directories; choose a name without that suffix"
        )
    return target


def _prepare_staging(path: Path, staging: Path, overwrite: bool) -> None:
    if not overwrite and (path.exists() or (previous_path(path) / MARKER).exists()):
        raise CheckpointError(f"{path} already exists; pass overwrite=True to replace it")
    if path.exists() and not path.is_dir():
        raise CheckpointError(f"{path} exists and is not a directory; choose another path")
    if staging.exists():
        shutil.rmtree(staging)  # left by a save that was killed: never loadable, safe to drop
    staging.mkdir(parents=True)
    write_in_progress(staging)


def _file_records(
    staging: Path, checksum: bool, process_group: dist.ProcessGroup | None
) -> dict[str, dict[str, int]]:
    """Every file's size and CRC32, on every rank; each rank hashes a share of the files."""
    me, world = _dist.rank(process_group), _dist.world_size(process_group)
    names = sorted(n for n in os.listdir(staging) if n != IN_PROGRESS) if me == 0 else []
    if _dist.is_distributed():
        box = [names]
        dist.broadcast_object_list(
            box, src=_dist.global_rank_of(0, process_group), group=process_group
        )
        names = box[0]
    records = {
        name: {
            "bytes": (staging / name).stat().st_size,
            "crc32": crc32_of(staging / name) if checksum else -1,
        }
        for name in names[me::world]
    }
    gathered = [records]
    if _dist.is_distributed():
        gathered = [{}] * world
        dist.all_gather_object(gathered, records, group=process_group)
    return {name: record for part in gathered for name, record in part.items()}


def _publish(path: Path, staging: Path) -> None:
    """Move the finished staging directory to ``path``, replacing an older checkpoint.

    Between the two renames ``path`` is missing and the older checkpoint sits complete at
    ``<path>.old``; ``load`` falls back to it there. ``.old`` is deleted only once ``path`` is
    the new checkpoint, so a kill at any step leaves one complete checkpoint to load.
    """
    old = previous_path(path)
    if path.exists():
        if old.exists():
            shutil.rmtree(old)  # left by an interrupted swap; ``path`` is complete, keep it
        path.rename(old)
        fsync_dir(path.parent)
    staging.rename(path)
    fsync_dir(path.parent)
    if old.exists():
        shutil.rmtree(old)


def save(
    state_dict: dict[str, Any],
    path: PathLike,
    *,
    process_group: dist.ProcessGroup | None = None,
    overwrite: bool = True,
    checksum: bool = True,
    planner: SavePlanner | None = None,
) -> Path:
    """Save ``state_dict`` as a DCP checkpoint at ``path``, atomically. Collective.

    ``checksum`` records a CRC32 of every file (each rank hashes a share of the files) so a
    later ``load`` detects corrupted data, not just truncated files. A rank that dies during
    the save makes the others raise ``PeerDiedError`` naming it.
    """
    with naming_dead_peers(f"saving the checkpoint {path}", process_group):
        target = check_target(path)
        staging = partial_path(target)
        first = _dist.rank(process_group) == 0
        problem = (
            _run_locally(lambda: _prepare_staging(target, staging, overwrite)) if first else None
        )
        _dist.agree(problem, process_group)
        try:
            with _dist.quiet_single_process(), naming_dead_peers(f"saving {target}", process_group):
                dcp_save(
                    state_dict,
                    storage_writer=FileSystemWriter(staging, sync_files=True),
                    planner=planner,
                    process_group=process_group,
                )
        except CheckpointException as error:
            raise CheckpointError(f"saving {target} failed on some rank: {error}") from None
        files = _file_records(staging, checksum, process_group)

        def finish() -> None:
            write_marker(staging, _dist.world_size(process_group), files)
            _publish(target, staging)

        _dist.agree(_run_locally(finish) if first else None, process_group)
        return target


def load(
    state_dict: dict[str, Any],
    path: PathLike,
    *,
    process_group: dist.ProcessGroup | None = None,
    strict: bool = True,
    verify: bool = True,
    planner: LoadPlanner | None = None,
    partitioned: bool = False,
) -> DirectoryInfo:
    """Load a DCP checkpoint into ``state_dict`` in place, after checking it. Collective.

    ``strict``: every key of ``state_dict`` must be in the checkpoint and no other key of the
    same top-level sections may be (``"model"``/``"optimizer"``: loading only ``"model"``
    from a model+optimizer checkpoint is fine). Optimizer placeholders the checkpoint has no
    value for are dropped, leaving that state fresh. ``verify`` checks the CRC32 recorded at
    save time (plain DCP directories without a marker are loaded unverified).
    ``partitioned``: each rank holds a part of the model (pipeline stages), so a checkpoint
    key is unexpected only when no rank's ``state_dict`` has it.
    """
    with naming_dead_peers(f"loading the checkpoint {path}", process_group):
        return _load(state_dict, Path(path), process_group, strict, verify, planner, partitioned)


def _load(
    state_dict: dict[str, Any],
    requested: Path,
    process_group: dist.ProcessGroup | None,
    strict: bool,
    verify: bool,
    planner: LoadPlanner | None,
    partitioned: bool,
) -> DirectoryInfo:
    me, world = _dist.rank(process_group), _dist.world_size(process_group)
    found: list[tuple[DirectoryInfo, KeyPlan, Comparison, str]] = []

    def local_checks() -> None:
        source = resolve_interrupted_swap(requested)
        info = inspect_directory(source)
        verify_files(info, (me, world), checksums=verify)
        metadata = read_metadata(source)
        plan = plan_key_map(state_dict, metadata, source, has_marker=info.marker is not None)
        where = f"{source} (named as by {plan.naming.describe()})" if plan.renames else str(source)
        every_key_here = strict and not partitioned
        comparison = check(plan.flat, metadata, where, every_key_here, sections=plan.sections)
        if strict and partitioned and comparison.missing:
            raise StateDictMismatchError(Comparison(missing=comparison.missing).message(where))
        found.append((info, plan, comparison, where))

    _dist.agree(_run_locally(local_checks), process_group)
    info, plan, comparison, where = found[0]
    if strict and partitioned:
        _refuse_keys_no_rank_loads(comparison.unexpected, where, process_group)
    source = info.path
    if plan.renames and me == 0:
        how = f"; {plan.derivation}" if plan.derivation else ""
        log.info("loading %s, named as by %s%s", source, plan.naming.describe(), how)
    prune(state_dict, plan.our_paths(comparison.prunable))
    if plan.renames:
        prune(plan.flat, comparison.prunable)
    try:
        with _dist.quiet_single_process(), naming_dead_peers(f"loading {source}", process_group):
            dcp_load(
                plan.flat,
                storage_reader=FileSystemReader(source),
                planner=planner or DefaultLoadPlanner(allow_partial_load=not strict),
                process_group=process_group,
            )
    except CheckpointException as error:
        raise CorruptCheckpointError(f"loading {source} failed on some rank: {error}") from None
    plan.copy_back(state_dict)
    return info
