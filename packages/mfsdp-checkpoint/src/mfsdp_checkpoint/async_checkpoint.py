"""Atomic checkpoints written in the background while training goes on: ``async_save`` copies
the state dict to host memory, then runs the ordinary atomic ``save`` on a background thread,
over a gloo group of its own (why each matters: the package README, "Asynchronous saves").
"""

from __future__ import annotations

import concurrent.futures
import copy
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from mfsdp_checkpoint import _dist
from mfsdp_checkpoint.atomic import PathLike, check_target, save
from mfsdp_checkpoint.checkpoint import checkpoint_state
from mfsdp_checkpoint.chunks import copy_dcp_protocol
from mfsdp_collectives import call_watching_peers


@dataclass
class _Channel:
    """The background writer of one group of ranks: its own process group and one thread."""

    parent: dist.ProcessGroup | None
    world: dist.ProcessGroup | None
    """The default group it was built under; a new one (re-initialised job) needs a new one."""
    group: dist.ProcessGroup | None
    executor: ThreadPoolExecutor
    pending: Future[Path] | None = None


_CHANNELS: dict[int, _Channel] = {}


def _default_group() -> dist.ProcessGroup | None:
    return dist.group.WORLD if _dist.is_distributed() else None


def _new_group(parent: dist.ProcessGroup | None) -> dist.ProcessGroup | None:
    if not _dist.is_distributed():
        return None
    # Without a parent, collective over every rank, like the caller; with one, only its members
    # call async_save. Made at the first async save, mid-run: a member that died before it is
    # named within seconds instead of holding the rendezvous to the store's timeout.
    ranks = list(range(dist.get_world_size()))
    options: dict[str, Any] = {}
    if parent is not None:
        ranks = dist.get_process_group_ranks(parent)
        options = {"ranks": ranks, "use_local_synchronization": True}
    group = call_watching_peers(
        lambda: dist.new_group(backend="gloo", **options),
        ranks,
        "creating the group of asynchronous checkpoints",
    )
    return cast(dist.ProcessGroup, group)


def _channel(process_group: dist.ProcessGroup | None) -> _Channel:
    key = 0 if process_group is None else id(process_group)
    found = _CHANNELS.get(key)
    if found is not None and found.parent is process_group and found.world is _default_group():
        return found
    if found is not None:
        found.executor.shutdown(wait=True)  # after its pending save
    channel = _Channel(
        parent=process_group,
        world=_default_group(),
        group=_new_group(process_group),
        executor=ThreadPoolExecutor(max_workers=1, thread_name_prefix="mfsdp-checkpoint"),
    )
    _CHANNELS[key] = channel
    return channel


def stage_state_dict(value: Any) -> Any:
    """A host-memory copy of a (nested) state dict that no later training step can change.

    DTensors stay DTensors with the same mesh, placements and global shape (only the local
    tensor is copied, to CPU) and keep their DCP row methods, so DCP writes the copy exactly
    as it would write the original.
    """
    if isinstance(value, DTensor):
        local = value.to_local().detach().to("cpu", copy=True)
        # The constructor, not ``from_local``: from_local would move ``local`` back to the
        # mesh's device, doubling accelerator memory for the life of the save. A host-memory
        # local tensor under an accelerator mesh is what torch's own stager produces too.
        staged = DTensor(local, value._spec, requires_grad=False)  # type: ignore[no-untyped-call]
        return copy_dcp_protocol(value, staged)
    if isinstance(value, torch.Tensor):
        return value.detach().to("cpu", copy=True)
    if isinstance(value, dict):
        return {key: stage_state_dict(item) for key, item in value.items()}
    if isinstance(value, list):
        return [stage_state_dict(item) for item in value]
    if isinstance(value, tuple):
        return tuple(stage_state_dict(item) for item in value)
    return copy.deepcopy(value)


class CheckpointStager:
    """``async_stager`` for torch's own ``dcp.async_save`` on our state dicts.

    torch's default stager decides whether a tensor has storage to copy from its
    ``data_ptr()``; a DTensor over a view at a non-zero offset of a flat buffer (every
    parameter after the first in ours) reports one although it is a wrapper without storage,
    and staging fails ("invalid python storage"). This stager copies with
    ``stage_state_dict`` instead: ``dcp.async_save(state, checkpoint_id=path,
    process_group=save_group, async_stager=CheckpointStager())``, with ``save_group`` a group
    of its own (``dist.new_group(backend="gloo")``) as for any background save.
    """

    _synchronize_after_execute = False

    @property
    def should_synchronize_after_execute(self) -> bool:
        return False  # staging is a synchronous host copy: nothing left to wait for

    def stage(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        return cast(dict[str, Any], stage_state_dict(state_dict))

    def synchronize_staging(self) -> None:
        """Nothing to wait for (see ``should_synchronize_after_execute``)."""

    def close(self) -> None:
        """Nothing to release: the stager holds no buffers between saves."""


def async_save(
    state_dict: dict[str, Any],
    path: PathLike,
    *,
    process_group: dist.ProcessGroup | None = None,
    overwrite: bool = True,
    checksum: bool = True,
) -> Future[Path]:
    """Start an atomic save of ``state_dict`` to ``path``; return once it is copied. Collective.

    The future's ``result()`` waits until the checkpoint is committed and returns ``path``, or
    raises the save's ``CheckpointError``. A call made while the previous save of the group is
    still writing first waits for it (its outcome stays in its own future), so at most one
    staged copy of the state lives in memory.
    """
    target = check_target(path)
    channel = _channel(process_group)
    if channel.pending is not None:
        concurrent.futures.wait([channel.pending])
    staged = stage_state_dict(state_dict)
    channel.pending = channel.executor.submit(
        save,
        staged,
        target,
        process_group=channel.group,
        overwrite=overwrite,
        checksum=checksum,
    )
    return channel.pending


def async_save_checkpoint(
    path: PathLike,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    extra: dict[str, Any] | None = None,
    process_group: dist.ProcessGroup | None = None,
    overwrite: bool = True,
) -> Future[Path]:
    """``save_checkpoint`` in the background (``async_save``): same files, read back by
    ``load_checkpoint``; returns as soon as the state is copied."""
    state = checkpoint_state(model, optimizer, extra)
    return async_save(state, path, process_group=process_group, overwrite=overwrite)
