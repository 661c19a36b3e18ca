"""One call to save or resume a sharded model and its optimizer: the seed README's snippet with
the safety added. On disk, a plain DCP checkpoint with sections ``"model"``, ``"optimizer"`` and
(optionally) ``"extra"``, so torch's own tools read it too."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from mfsdp_checkpoint.atomic import PathLike, load, save
from mfsdp_checkpoint.enable import enable_dcp, named_optimizer_state_dict
from mfsdp_checkpoint.naming import SaveNaming, named_for


def checkpoint_state(
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    extra: dict[str, Any] | None,
    *,
    weights: bool = True,
) -> dict[str, Any]:
    """The DCP state dict of a checkpoint: sections ``model`` (with ``weights``),
    ``optimizer``, ``extra``."""
    enable_dcp(model)
    state: dict[str, Any] = {"model": model.state_dict()} if weights else {}
    if optimizer is not None:
        state["optimizer"] = named_optimizer_state_dict(model, optimizer)
    if extra is not None:
        state["extra"] = dict(extra)
    return state


def save_checkpoint(
    path: PathLike,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    extra: dict[str, Any] | None = None,
    process_group: dist.ProcessGroup | None = None,
    overwrite: bool = True,
    naming: SaveNaming = "native",
) -> Path:
    """Save ``model`` (and ``optimizer``, and picklable ``extra`` values) atomically.

    ``naming`` names the keys for the job that will load the checkpoint (``naming.named_for``;
    ``load_checkpoint`` reads every naming anyway).
    """
    state = named_for(checkpoint_state(model, optimizer, extra), naming)
    return save(state, path, process_group=process_group, overwrite=overwrite)


def load_checkpoint(
    path: PathLike,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    extra: dict[str, Any] | None = None,
    process_group: dist.ProcessGroup | None = None,
    strict: bool = True,
    weights: bool = True,
) -> dict[str, Any]:
    """Load what ``save_checkpoint`` wrote (or any DCP checkpoint with these sections).

    Works across world sizes and sharding strategies. ``extra`` gives the keys (and default
    values) to read back from the ``"extra"`` section; the loaded values are returned.
    ``weights=False`` leaves the model's weights as they are and reads only the optimizer
    (and ``extra``): ``model`` then only names the optimizer state (a trainer that loads the
    weights before it builds the optimizer reads them once).
    """
    state = checkpoint_state(model, optimizer, extra, weights=weights)
    load(state, path, process_group=process_group, strict=strict)
    if weights:
        model.load_state_dict(state["model"], strict=strict)
    if optimizer is not None:
        optimizer.load_state_dict(state["optimizer"])
    result: dict[str, Any] = state.get("extra", {})
    return result
