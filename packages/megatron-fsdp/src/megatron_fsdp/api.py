"""The seed README's entry points: fully_shard, fully_shard_model, fully_shard_optimizer.

Every documented argument is accepted by name. Arguments whose layer is not built yet raise
``NotImplementedError`` naming the argument when set to anything but their default, so no
option is silently ignored.
"""

from __future__ import annotations

from collections.abc import Sequence

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
    checked by ``engine_options.sharding_options``, whose signature this one repeats, into
    one ``mfsdp_hooks.ShardingOptions`` record (the seed's names) that the engine takes. Those
    whose feature is not built yet raise ``NotImplementedError`` naming the argument when
    set to anything but their default.

    Args:
        module: the model to shard, in place.
        fsdp_unit_modules: classes (or ``"import.path.Class"`` strings) of the submodules
            that become FSDP units, gathered and freed one at a time (the seed README
            requires them for strategies 1-3).
        device_mesh: the ``DeviceMesh`` to shard over. None: a 1-D mesh over all ranks of
            the default process group.
        dp_shard_dim: name of ``device_mesh``'s sub-mesh FSDP shards over (often the
            flattened DP x CP dim). Required when ``device_mesh`` has more than one dim.
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
        overlap_param_gather: prefetch parameter all-gathers to overlap forward and backward
            compute.
        sync_model_each_microbatch: finish every gradient reduction after each backward, so
            gradients are ready between steps; False leaves ``no_sync`` micro-batches'
            reductions in flight until the optimizer step.
        preproc_state_dict_for_dcp_ckpt: make ``model.state_dict()`` ready for
            ``torch.distributed.checkpoint`` save and load (DTensor shards, resharding).
        average_in_collective: average gradients inside the reduction collective (else
            pre-scale by 1/N and sum); the result is the same mean.
        gradient_scaling_factor: pre-scale gradients by this instead of averaging.
        calculate_per_token_loss: sum gradients unscaled (the loss is already normalised
            by the global token count).
        report_nan_in_param_grad: check every reduced gradient for NaN/Inf and raise naming
            the parameter (slow).
        enable_fine_grained_param_gather: all-gather per submodule instead of per unit: each
            parameter-holding leaf module of a unit (Linear, norm...) is gathered just before
            it runs, prefetched one ahead, so a unit's forward holds about one leaf's
            unsharded weights (ZeRO-3 only; tied leaves stay in their unit).
        keep_fp8_transpose_cache: keep Transformer Engine's FP8 transpose cache. Not
            supported yet.
        nccl_ub: allocate and register NCCL user buffers. Not supported yet.
        fsdp_manual_registration: register NCCL user buffers manually (with ``nccl_ub``).
            Not supported yet.
        disable_symmetric_registration: no NCCL window (symmetric) registration for
            ``nccl_ub``. Not supported yet.
        fsdp_double_buffer: persistent double buffers for the gradient reduce-scatter
            inputs instead of per-reduction allocations (slots per buffer size; a request
            they cannot serve is allocated afresh).
        fsdp_db_use_persist_buf_on_alloc_fail: with ``fsdp_double_buffer``, a request the
            double buffer cannot serve gets a buffer kept for its unit instead of a fresh
            allocation (registrable memory, at the cost of keeping it).
        use_decoupled_grad: hand the reduced gradients to the optimizer in each parameter's
            ``decoupled_grad`` instead of ``.grad`` (for optimizers that read it, e.g.
            Transformer Engine's ``FusedAdam(use_decoupled_grad=True)``; torch's built-in
            optimizers are refused by ``fully_shard_optimizer``). The same as
            ``MixedPrecisionPolicy(use_decoupled_grad=True)``.
        host_transport: how CPU collectives travel: "auto" (shared memory when every rank
            of the shard group is on this host, else gloo), "shm" or "gloo".
        backward_prefetch_grad_fraction: in backward, a unit prefetches the next unit's
            weights once this fraction of its gradient elements arrived (0.0: at its
            pre-backward, as FSDP2).
        reshard_after_forward_group_size: after a unit's forward, keep its weights sharded
            over this many consecutive ranks of ``dp_shard_dim`` (e.g. one node's) instead of
            the whole group, so its backward all-gather stays among them, for ``P / size``
            elements more per rank between forward and backward (FSDP2's
            ``reshard_after_forward=<int>``, DeepSpeed's hpZ). A divisor of the shard group's
            size; ZeRO-3 only. None: reshard over the whole group.
        check_replicas: compare, at each unit's wrap, the values of its weights across the
            ranks, and raise on every rank naming the first weight that differs when the
            ranks built the model with different values (different seeds): sharded, each
            rank would train its slice of its own weights. False when you load the weights
            into the sharded model after wrapping.
        optimizer_cpu_offload: Megatron-LM's ``--optimizer-cpu-offload``, for the whole
            optimizer: the sharded fp32 main weights, their gradients and the optimizer
            state live on the host (pinned) and the optimizer steps there, while the
            accelerator computes; each unit's shard is copied to the device for its
            all-gather and its reduced gradient shard copied back (FSDP2's
            ``CPUOffloadPolicy(pin_memory=True)``). ZeRO-1/2/3 and HSDP; refused with
            ``zero_dp_strategy=0`` and with ``outer_dp_sharding_strategy="optim"``. On CPU the
            state is on the host already: nothing moves.
    """
    options = sharding_options(
        module,
        fsdp_unit_modules,
        device_mesh=device_mesh,
        dp_shard_dim=dp_shard_dim,
        dp_outer_dim=dp_outer_dim,
        tp_dim=tp_dim,
        hybrid_fsdp_group=hybrid_fsdp_group,
        expt_device_mesh=expt_device_mesh,
        device=device,
        mixed_precision_policy=mixed_precision_policy,
        zero_dp_strategy=zero_dp_strategy,
        outer_dp_sharding_strategy=outer_dp_sharding_strategy,
        init_model_with_meta_device=init_model_with_meta_device,
        grad_reduce_in_fp32=grad_reduce_in_fp32,
        preserve_fp32_weights=preserve_fp32_weights,
        overlap_grad_reduce=overlap_grad_reduce,
        overlap_param_gather=overlap_param_gather,
        sync_model_each_microbatch=sync_model_each_microbatch,
        average_in_collective=average_in_collective,
        gradient_scaling_factor=gradient_scaling_factor,
        calculate_per_token_loss=calculate_per_token_loss,
        report_nan_in_param_grad=report_nan_in_param_grad,
        enable_fine_grained_param_gather=enable_fine_grained_param_gather,
        keep_fp8_transpose_cache=keep_fp8_transpose_cache,
        nccl_ub=nccl_ub,
        fsdp_manual_registration=fsdp_manual_registration,
        disable_symmetric_registration=disable_symmetric_registration,
        fsdp_double_buffer=fsdp_double_buffer,
        fsdp_db_use_persist_buf_on_alloc_fail=fsdp_db_use_persist_buf_on_alloc_fail,
        use_decoupled_grad=use_decoupled_grad,
        host_transport=host_transport,
        backward_prefetch_grad_fraction=backward_prefetch_grad_fraction,
        reshard_after_forward_group_size=reshard_after_forward_group_size,
        check_replicas=check_replicas,
        optimizer_cpu_offload=optimizer_cpu_offload,
    )
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


def _dist_or_self(param: torch.Tensor) -> torch.Tensor:
    found = dist_param_of(param)
    return param if found is None else found


def _rebind_optimizer(optimizer: torch.optim.Optimizer) -> None:
    """Point an optimizer built on the original parameters at their sharded replacements
    (a no-op for one built on the sharded model)."""
    rebound = False
    for group in optimizer.param_groups:
        params = [_dist_or_self(p) for p in group["params"]]
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

    ``fully_shard_model(module, fsdp_unit_modules, ...)`` with every other argument, then
    ``optimizer`` pointed at the sharded parameters (its state cleared) and given
    ``fully_shard_optimizer(optimizer, preproc_state_dict_for_dcp_ckpt)``. Returns
    ``(model, optimizer)``.

    Args:
        module: the model to shard, in place.
        optimizer: a ``torch.optim.Optimizer`` already built on ``module``'s parameters;
            its param groups and hyperparameters are kept.
        fsdp_unit_modules: classes (or import paths) of the submodules that become FSDP
            units.

    Every keyword argument (``device_mesh`` ... ``optimizer_cpu_offload``) has
    the name, default and meaning it has in :func:`fully_shard_model`, whose docstring
    describes each; ``preproc_state_dict_for_dcp_ckpt`` applies to the optimizer too.
    """
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(
            f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}"
        )
    model = fully_shard_model(
        module,
        fsdp_unit_modules,
        device_mesh=device_mesh,
        dp_shard_dim=dp_shard_dim,
        dp_outer_dim=dp_outer_dim,
        tp_dim=tp_dim,
        hybrid_fsdp_group=hybrid_fsdp_group,
        expt_device_mesh=expt_device_mesh,
        device=device,
        mixed_precision_policy=mixed_precision_policy,
        zero_dp_strategy=zero_dp_strategy,
        outer_dp_sharding_strategy=outer_dp_sharding_strategy,
        init_model_with_meta_device=init_model_with_meta_device,
        grad_reduce_in_fp32=grad_reduce_in_fp32,
        preserve_fp32_weights=preserve_fp32_weights,
        overlap_grad_reduce=overlap_grad_reduce,
        overlap_param_gather=overlap_param_gather,
        sync_model_each_microbatch=sync_model_each_microbatch,
        preproc_state_dict_for_dcp_ckpt=preproc_state_dict_for_dcp_ckpt,
        average_in_collective=average_in_collective,
        gradient_scaling_factor=gradient_scaling_factor,
        calculate_per_token_loss=calculate_per_token_loss,
        report_nan_in_param_grad=report_nan_in_param_grad,
        enable_fine_grained_param_gather=enable_fine_grained_param_gather,
        keep_fp8_transpose_cache=keep_fp8_transpose_cache,
        nccl_ub=nccl_ub,
        fsdp_manual_registration=fsdp_manual_registration,
        disable_symmetric_registration=disable_symmetric_registration,
        fsdp_double_buffer=fsdp_double_buffer,
        fsdp_db_use_persist_buf_on_alloc_fail=fsdp_db_use_persist_buf_on_alloc_fail,
        use_decoupled_grad=use_decoupled_grad,
        host_transport=host_transport,
        backward_prefetch_grad_fraction=backward_prefetch_grad_fraction,
        reshard_after_forward_group_size=reshard_after_forward_group_size,
        check_replicas=check_replicas,
        optimizer_cpu_offload=optimizer_cpu_offload,
    )
    _rebind_optimizer(optimizer)
    return model, fully_shard_optimizer(
        optimizer, preproc_state_dict_for_dcp_ckpt=preproc_state_dict_for_dcp_ckpt
    )
