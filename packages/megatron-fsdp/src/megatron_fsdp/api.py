"""The seed README's entry points: fully_shard, fully_shard_model, fully_shard_optimizer.

Every documented argument is accepted by name. Arguments whose layer is not built yet raise
``NotImplementedError`` naming the argument when set to anything but their default, so no
option is silently ignored.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from megatron_fsdp.engine_options import engine_kwargs
from megatron_fsdp.wrapper import MegatronFSDP
from mfsdp_checkpoint import enable_dcp
from mfsdp_hooks import attach_optimizer, dist_param_of, optimizer_groups, owning_model
from mfsdp_hooks.megatron_fsdp import UnitSpec


def fully_shard_model(
    module: nn.Module,
    fsdp_unit_modules: Sequence[UnitSpec] | None = None,
    *,
    preproc_state_dict_for_dcp_ckpt: bool = True,
    **options: Any,
) -> MegatronFSDP:
    """Shard ``module`` (every ``fsdp_unit_modules`` match, then the root) and wrap it.

    ``options``: the seed README's keyword arguments (``engine_options.engine_kwargs`` lists
    and checks them: meshes and dims, strategies, precision, overlap, gradient options).
    """
    kwargs = engine_kwargs(module, fsdp_unit_modules, **options)
    wrapped = MegatronFSDP.from_engine_kwargs(kwargs)
    if preproc_state_dict_for_dcp_ckpt:
        enable_dcp(wrapped)
    return wrapped


def fully_shard_optimizer(
    optimizer: torch.optim.Optimizer,
    preproc_state_dict_for_dcp_ckpt: bool = True,
    *,
    contiguous_step: bool | None = None,
    step_chunk_numel: int | None = None,
) -> torch.optim.Optimizer:
    """Add ``sync_grad_before_optimizer_step``/``install_optimized_model_weights`` to ``step``
    and ``zero_grad_buffer`` to ``zero_grad`` of an optimizer built on the sharded model.

    With ``preproc_state_dict_for_dcp_ckpt`` its ``state_dict()`` is keyed by the sharded
    model's parameter names and holds DTensors that ``torch.distributed.checkpoint`` saves
    and reshards directly. ``contiguous_step``/``step_chunk_numel``: see
    :func:`mfsdp_hooks.attach_optimizer`.
    """
    attach_optimizer(optimizer, contiguous_step=contiguous_step, step_chunk_numel=step_chunk_numel)
    if preproc_state_dict_for_dcp_ckpt:
        models = {id(m): m for m in (owning_model(g) for g in optimizer_groups(optimizer)) if m}
        for model in models.values():
            enable_dcp(model, optimizer)
    return optimizer


def _dist_or_self(param: torch.Tensor) -> torch.Tensor:
    found = dist_param_of(param)
    return param if found is None else found


def _rebind_optimizer(optimizer: torch.optim.Optimizer) -> None:
    """Point an optimizer built on the original parameters at their sharded replacements."""
    for group in optimizer.param_groups:
        group["params"] = [_dist_or_self(p) for p in group["params"]]
    optimizer.state.clear()


def fully_shard(
    module: nn.Module,
    optimizer: torch.optim.Optimizer,
    fsdp_unit_modules: Sequence[UnitSpec] | None = None,
    **kwargs: Any,
) -> tuple[MegatronFSDP, torch.optim.Optimizer]:
    """One-line change for an initialised model and optimizer: shard both, keep param groups."""
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(
            f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}"
        )
    preproc = kwargs.get("preproc_state_dict_for_dcp_ckpt", True)
    model = fully_shard_model(module, fsdp_unit_modules, **kwargs)
    _rebind_optimizer(optimizer)
    return model, fully_shard_optimizer(optimizer, preproc_state_dict_for_dcp_ckpt=preproc)
