"""The seed README's entry points: fully_shard, fully_shard_model, fully_shard_optimizer.

An argument whose feature is not built yet raises ``NotImplementedError`` naming it when set
to anything but its default, so no option is silently ignored.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from megatron_fsdp.engine_options import sharding_options
from megatron_fsdp.wrapper import MegatronFSDP
from mfsdp_checkpoint import enable_dcp
from mfsdp_hooks import (
    MixedPrecisionPolicy,
    UnitSpec,
    attach_optimizer,
    dist_param_of,
    optimizer_groups,
    owning_model,
)


def fully_shard_model(
    module: nn.Module,
    fsdp_unit_modules: Sequence[UnitSpec] | None = None,
    *,
    device_mesh: DeviceMesh | None = None,
    dp_shard_dim: str | None = None,
    dp_outer_dim: str | None = None,
    tp_dim: str | None = None,
    hybrid_fsdp_group: dist.ProcessGroup | None = None,
    expt_device_mesh: DeviceMesh | None = None,
    device: torch.device | str | None = None,
    mixed_precision_policy: MixedPrecisionPolicy | None = None,
    zero_dp_strategy: int | str = 3,
    outer_dp_sharding_strategy: int | str = 0,
    init_model_with_meta_device: bool = False,
    grad_reduce_in_fp32: bool = False,
    preserve_fp32_weights: bool = True,
    overlap_grad_reduce: bool = True,
    overlap_param_gather: bool = True,
    sync_model_each_microbatch: bool = True,
    preproc_state_dict_for_dcp_ckpt: bool = True,
    average_in_collective: bool = True,
    gradient_scaling_factor: float | None = None,
    calculate_per_token_loss: bool = False,
    report_nan_in_param_grad: bool = False,
    enable_fine_grained_param_gather: bool = False,
    keep_fp8_transpose_cache: bool = False,
    nccl_ub: bool = False,
    fsdp_manual_registration: bool = False,
    disable_symmetric_registration: bool = False,
    fsdp_double_buffer: bool = False,
    fsdp_db_use_persist_buf_on_alloc_fail: bool = False,
    use_decoupled_grad: bool = False,
    host_transport: str = "auto",
    backward_prefetch_grad_fraction: float = 0.5,
    reshard_after_forward_group_size: int | None = None,
    check_replicas: bool = True,
    optimizer_cpu_offload: bool = False,
) -> MegatronFSDP:
    """Shard ``module`` (every ``fsdp_unit_modules`` match, then the root) and wrap it.

    Returns a ``MegatronFSDP``; the original module is its ``.module``. The arguments are
    checked by ``engine_options.sharding_options``, whose signature this one repeats.

    Args:
        module: the model to shard, in place.
        fsdp_unit_modules: classes (or ``"import.path.Class"`` strings) of the submodules
            that become FSDP units, gathered and freed one at a time (required for
            strategies 1-3).
        device_mesh: the ``DeviceMesh`` to shard over. None: a 1-D mesh over all ranks.
        dp_shard_dim: name of the sub-mesh FSDP shards over (often the flattened DP x CP
            dim). Required when ``device_mesh`` has more than one dim.
        dp_outer_dim: name of the "outer" DP sub-mesh; giving it turns on HSDP (needs
            ``hybrid_fsdp_group`` too).
        tp_dim: name of the tensor-parallel sub-mesh, for (FSDP, TP)-strided sharding of
            DTensor or Megatron-style TP parameters.
        hybrid_fsdp_group: the process group of the flattened (``dp_outer_dim``,
            ``dp_shard_dim``) sub-mesh. Required for HSDP.
        expt_device_mesh: a second ``DeviceMesh`` for expert (MoE) parameters; its
            ``dp_shard_dim``/``tp_dim`` dims are expert data / tensor parallelism.
        device: move the model here before sharding (ignored with
            ``init_model_with_meta_device``). None: where its parameters already are.
        mixed_precision_policy: a ``megatron_fsdp.MixedPrecisionPolicy`` (compute, reduce,
            main-weight and main-gradient dtypes). Not together with ``grad_reduce_in_fp32``
            or ``preserve_fp32_weights=False``.
        zero_dp_strategy: what is sharded over ``dp_shard_dim``: 0/"no_shard" (DDP),
            1/"optim" (optimizer state), 2/"optim_grads" (+ gradients, ZeRO-2),
            3/"optim_grads_params" (+ parameters, ZeRO-3).
        outer_dp_sharding_strategy: HSDP's outer group: 0/"no_shard" replicates across
            ``dp_outer_dim``; 1/"optim" (HFSDP, needs ``zero_dp_strategy=3``) also shards the
            optimizer state across it.
        init_model_with_meta_device: materialise a ``meta``-device model unit by unit,
            sharded, with each module's ``reset_parameters()``, so the whole model never
            exists on one rank.
        grad_reduce_in_fp32: reduce gradients in float32.
        preserve_fp32_weights: keep float32 main weights for the optimizer to step on.
        overlap_grad_reduce: overlap gradient reduce-scatter (all-reduce for no_shard) with
            backward compute.
        overlap_param_gather: prefetch parameter all-gathers to overlap compute.
        sync_model_each_microbatch: finish every gradient reduction after each backward;
            False leaves ``no_sync`` micro-batches' reductions in flight until the step.
        preproc_state_dict_for_dcp_ckpt: make ``model.state_dict()`` ready for
            ``torch.distributed.checkpoint`` save and load (DTensor shards, resharding).
        average_in_collective: average gradients inside the reduction collective (else
            pre-scale by 1/N and sum); the result is the same mean.
        gradient_scaling_factor: pre-scale gradients by this instead of averaging.
        calculate_per_token_loss: sum gradients unscaled (the loss is already normalised
            by the global token count).
        report_nan_in_param_grad: check every reduced gradient for NaN/Inf and raise naming
            the parameter (slow).
        enable_fine_grained_param_gather: gather each parameter-holding leaf module of a
            unit (Linear, norm...) just before it runs, prefetched one ahead, so a unit's
            forward holds about one leaf's unsharded weights (ZeRO-3 only; tied leaves stay
            in their unit).
        keep_fp8_transpose_cache: keep Transformer Engine's FP8 transpose cache. Not
            supported yet.
        nccl_ub: allocate and register NCCL user buffers. Not supported yet.
        fsdp_manual_registration: register NCCL user buffers manually. Not supported yet.
        disable_symmetric_registration: no NCCL window (symmetric) registration for
            ``nccl_ub``. Not supported yet.
        fsdp_double_buffer: persistent double buffers (slots per buffer size) for the
            gradient reduce-scatter inputs; a request they cannot serve is allocated afresh.
        fsdp_db_use_persist_buf_on_alloc_fail: with ``fsdp_double_buffer``, a request the
            slots cannot serve gets a buffer kept for its unit instead (registrable memory,
            at the cost of keeping it).
        use_decoupled_grad: hand the reduced gradients to the optimizer in each parameter's
            ``decoupled_grad`` instead of ``.grad`` (e.g. for Transformer Engine's
            ``FusedAdam(use_decoupled_grad=True)``; ``fully_shard_optimizer`` refuses torch's
            built-in optimizers). As ``MixedPrecisionPolicy(use_decoupled_grad=True)``.
        host_transport: how CPU collectives travel: "auto" (shared memory when every rank
            of the shard group is on this host, else gloo), "shm" or "gloo".
        backward_prefetch_grad_fraction: in backward, a unit prefetches the next unit's
            weights once this fraction of its gradient elements arrived (0.0: at its
            pre-backward, as FSDP2).
        reshard_after_forward_group_size: after a unit's forward, keep its weights sharded
            over this many consecutive ranks of ``dp_shard_dim`` (e.g. one node's), so its
            backward all-gather stays among them, for ``P / size`` more elements per rank
            until backward (FSDP2's ``reshard_after_forward=<int>``, DeepSpeed's hpZ). A
            divisor of the shard group's size; ZeRO-3 only. None: the whole group.
        check_replicas: at each unit's wrap, compare its weights' values across the ranks
            and raise on every rank naming the first that differs (ranks that built the
            model with different seeds would each train a slice of their own weights).
            False when you load the weights into the sharded model after wrapping.
        optimizer_cpu_offload: Megatron-LM's ``--optimizer-cpu-offload`` for the whole
            optimizer (FSDP2's ``CPUOffloadPolicy(pin_memory=True)``): the fp32 main weight
            shards, their gradients and the optimizer state live pinned on the host, where
            the optimizer steps; each unit's shard is copied to the device for its gather
            and its reduced gradient shard back. ZeRO-1/2/3 and HSDP; refused with
            ``zero_dp_strategy=0`` and ``outer_dp_sharding_strategy="optim"``. On CPU
            nothing moves.
    """
    passed = _passed_on(locals(), "module", "fsdp_unit_modules", "preproc_state_dict_for_dcp_ckpt")
    options = sharding_options(module, fsdp_unit_modules, **passed)
    wrapped = MegatronFSDP(module, fsdp_unit_modules=fsdp_unit_modules, options=options)
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
    :func:`mfsdp_hooks.attach_optimizer`. An optimizer built before the model was sharded
    is re-pointed at the sharded parameters first (its state, if any, starts afresh).
    """
    _rebind_optimizer(optimizer)
    attach_optimizer(optimizer, contiguous_step=contiguous_step, step_chunk_numel=step_chunk_numel)
    if preproc_state_dict_for_dcp_ckpt:
        models = {id(m): m for m in (owning_model(g) for g in optimizer_groups(optimizer)) if m}
        for model in models.values():
            enable_dcp(model, optimizer)
    return optimizer


def _passed_on(arguments: dict[str, Any], *own: str) -> dict[str, Any]:
    """An entry point's ``locals()``, taken before it assigns any name (its parameters), less
    ``own``: the keyword arguments it passes on unchanged. Its signature repeats the callee's,
    name for name (``tests/test_megatron_fsdp_signatures.py``)."""
    return {name: value for name, value in arguments.items() if name not in own}


def _rebind_optimizer(optimizer: torch.optim.Optimizer) -> None:
    """Point an optimizer built on the original parameters at their sharded replacements
    (a no-op for one built on the sharded model)."""
    rebound = False
    for group in optimizer.param_groups:
        params = [p if (d := dist_param_of(p)) is None else d for p in group["params"]]
        rebound |= any(new is not old for new, old in zip(params, group["params"], strict=True))
        group["params"] = params
    if rebound:  # state keyed by the replaced parameters would never be read again
        optimizer.state.clear()


def fully_shard(
    module: nn.Module,
    optimizer: torch.optim.Optimizer,
    fsdp_unit_modules: Sequence[UnitSpec] | None = None,
    *,
    device_mesh: DeviceMesh | None = None,
    dp_shard_dim: str | None = None,
    dp_outer_dim: str | None = None,
    tp_dim: str | None = None,
    hybrid_fsdp_group: dist.ProcessGroup | None = None,
    expt_device_mesh: DeviceMesh | None = None,
    device: torch.device | str | None = None,
    mixed_precision_policy: MixedPrecisionPolicy | None = None,
    zero_dp_strategy: int | str = 3,
    outer_dp_sharding_strategy: int | str = 0,
    init_model_with_meta_device: bool = False,
    grad_reduce_in_fp32: bool = False,
    preserve_fp32_weights: bool = True,
    overlap_grad_reduce: bool = True,
    overlap_param_gather: bool = True,
    sync_model_each_microbatch: bool = True,
    preproc_state_dict_for_dcp_ckpt: bool = True,
    average_in_collective: bool = True,
    gradient_scaling_factor: float | None = None,
    calculate_per_token_loss: bool = False,
    report_nan_in_param_grad: bool = False,
    enable_fine_grained_param_gather: bool = False,
    keep_fp8_transpose_cache: bool = False,
    nccl_ub: bool = False,
    fsdp_manual_registration: bool = False,
    disable_symmetric_registration: bool = False,
    fsdp_double_buffer: bool = False,
    fsdp_db_use_persist_buf_on_alloc_fail: bool = False,
    use_decoupled_grad: bool = False,
    host_transport: str = "auto",
    backward_prefetch_grad_fraction: float = 0.5,
    reshard_after_forward_group_size: int | None = None,
    check_replicas: bool = True,
    optimizer_cpu_offload: bool = False,
) -> tuple[MegatronFSDP, torch.optim.Optimizer]:
    """One-line change for an initialised model and optimizer: shard both, keep param groups.

    ``fully_shard_model(module, fsdp_unit_modules, ...)`` with every other argument (each as
    :func:`fully_shard_model` describes it), then ``fully_shard_optimizer(optimizer,
    preproc_state_dict_for_dcp_ckpt)``, which points ``optimizer`` (built on ``module``'s
    parameters) at the sharded ones, clearing its state but keeping its param groups.
    Returns ``(model, optimizer)``.
    """
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(
            f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}"
        )
    passed = _passed_on(locals(), "module", "optimizer", "fsdp_unit_modules")
    model = fully_shard_model(module, fsdp_unit_modules, **passed)
    return model, fully_shard_optimizer(
        optimizer, preproc_state_dict_for_dcp_ckpt=preproc_state_dict_for_dcp_ckpt
    )
