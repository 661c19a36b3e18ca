"""``enable_dcp``: make a sharded model's (and optimizer's) state dicts DCP-ready (what
``preproc_state_dict_for_dcp_ckpt=True`` turns on). The seed README's plain ``dcp.save``/
``dcp.load`` snippet is exact without it too (``mfsdp_hooks``' row-sharded DTensors answer DCP
themselves); it adds name-keyed optimizer state, placeholders for an optimizer that never
stepped, and Megatron-Core strided TP partitions, which it alone can save.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from mfsdp_checkpoint.chunks import group_chunks
from mfsdp_checkpoint.model_hooks import UnitCheckpointHooks, install_unit_hooks
from mfsdp_checkpoint.optim_hooks import OptimizerCheckpointHooks, install_optimizer_hooks
from mfsdp_hooks import fsdp_units


@dataclass
class DCPHandle:
    """What ``enable_dcp`` installed; ``remove()`` restores plain torch behaviour."""

    unit_hooks: list[UnitCheckpointHooks] = field(default_factory=list)
    optimizer_hooks: OptimizerCheckpointHooks | None = None

    def remove(self) -> None:
        for hooks in self.unit_hooks:
            hooks.remove()
        if self.optimizer_hooks is not None:
            self.optimizer_hooks.remove()


def enable_dcp(model: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> DCPHandle:
    """Install the checkpoint hooks on every FSDP unit of ``model`` and on ``optimizer``.

    Idempotent for the model; calling it again with an optimizer adds (or refreshes) the
    optimizer's hooks. The per-parameter DCP metadata is computed here, once, from the engine's
    layout (no communication). Optimizer state names are relative to ``model`` (pass
    ``wrapper.module`` for the unwrapped model's names, e.g. to exchange checkpoints with FSDP2).
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
    units = fsdp_units(model)
    if not units:
        raise ValueError(
            "model: no fully-sharded module found; call mfsdp_hooks.fully_shard (or wrap it in "
            "MegatronFSDP) before enable_dcp"
        )
    if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(
            f"optimizer must be a torch.optim.Optimizer or None, got {type(optimizer).__name__}"
        )
    handle = DCPHandle([install_unit_hooks(unit) for unit in units])
    for unit in units:
        for group in unit.groups:
            group_chunks(group)
    if optimizer is not None:
        handle.optimizer_hooks = install_optimizer_hooks(optimizer, model)
    return handle


def named_optimizer_state_dict(
    model: nn.Module, optimizer: torch.optim.Optimizer
) -> dict[str, Any]:
    """``optimizer``'s state keyed by parameter names relative to ``model`` (the names torch's
    ``get_optimizer_state_dict`` gives, what ``save_checkpoint`` writes), DCP-annotated;
    installs the hooks first (``enable_dcp``)."""
    hooks = enable_dcp(model, optimizer).optimizer_hooks
    assert hooks is not None  # enable_dcp was given the optimizer
    return hooks.named_state_dict()
