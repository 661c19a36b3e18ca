"""Block-quantized collectives for a whole model (or one part of it), in one call, set
through FSDP2's comm hooks so they reach the units of every entry point. A unit whose chunk
per rank is smaller than one block (norms, biases, a small head) keeps full precision. What
travels and how errors are reported: ``mfsdp_collectives.comms.quantized``.
"""

from __future__ import annotations

from torch import nn

from mfsdp_collectives import (
    CODED_DTYPES,
    BlockQuantization,
    CollectiveWorker,
    QuantizationBuffers,
    QuantizationErrorLog,
    QuantizedAllGather,
    QuantizedReduceScatter,
)
from mfsdp_hooks.api.fsdp_module import FSDPModule
from mfsdp_hooks.runtime.comm_hook_setter import checked_comm_hooks, set_comm_hooks
from mfsdp_hooks.runtime.root import unit_paths
from mfsdp_hooks.runtime.unit import FSDPUnit

__all__ = ["INT8", "quantize_communication"]

INT8 = BlockQuantization(bits=8, block=2048)
"""The default: int8 codes, one fp32 scale per 2048 values (ZeRO++'s choice)."""


def quantize_communication(
    module: nn.Module,
    *,
    gradients: BlockQuantization | None = INT8,
    weights: BlockQuantization | None = None,
    background: bool | None = None,
    error_log: QuantizationErrorLog | None = None,
) -> list[FSDPModule]:
    """Carry the gradient reduce-scatters (``gradients``, int8 with 2048-element blocks by
    default) and the weight all-gathers (``weights``, off by default) of every unit under
    ``module`` block-quantized; ``None`` leaves that collective in full precision (a
    quantized comm an earlier call set is removed; a comm of the user's is left as it is).
    Returns the units changed. 1-D parameters (norm weights, biases) travel exactly, in fp32
    beside the codes. Under an int ``reshard_after_forward`` the backward gather carries the
    forward's dequantized weights exactly (ZeRO++'s qwZ with hpZ). ``background`` (default:
    on gloo groups) and ``error_log``: see the package README. Call it between iterations, on
    every rank alike; where quantized weights cannot be honoured it raises, naming the unit,
    before any unit changes."""
    for name, value in (("gradients", gradients), ("weights", weights)):
        if value is not None and not isinstance(value, BlockQuantization):
            raise TypeError(
                f"{name} must be a mfsdp_collectives.BlockQuantization or None, got "
                f"{type(value).__name__}"
            )
    units = unit_paths(module)
    if not units:
        raise ValueError(
            f"{type(module).__name__} holds no fully-sharded unit: wrap it (fully_shard, "
            "fully_shard_model, MegatronFSDP) before quantize_communication"
        )
    if weights is not None:
        _check_weights_can_be_quantized(units)
    # a comm per unit (named, for the error log), all sharing one set of reused buffers and
    # one worker thread per kind of collective
    buffers = QuantizationBuffers()
    kinds = (
        ("reduce_scatter", gradients, QuantizedReduceScatter),
        ("all_gather", weights, QuantizedAllGather),
    )
    workers = {kind: CollectiveWorker() for kind, spec, _ in kinds if spec is not None}
    changes: list[tuple[FSDPUnit, dict[str, object]]] = []
    for path, unit in units:
        name, exact = path or "root", _one_dim_ranges(unit)
        change: dict[str, object] = {}
        for kind, spec, comm in kinds:
            if spec is not None:
                change[kind] = comm(
                    spec,
                    buffers=buffers,
                    background=background,
                    worker=workers[kind],
                    error_log=error_log,
                    name=name,
                    exact=exact,
                )
            elif isinstance(getattr(unit.comm_hooks, kind), comm):  # an earlier call's comm
                change[kind] = None
        checked_comm_hooks(unit, **change)  # every unit is checked before any changes
        changes.append((unit, change))
    for unit, change in changes:
        set_comm_hooks(unit, **change)
    return [m for m in module.modules() if isinstance(m, FSDPModule)]


def _check_weights_can_be_quantized(units: list[tuple[str, FSDPUnit]]) -> None:
    """Raise, naming the unit, before any unit is changed, where the gathered weights are
    not floating values (float8 weights travel as bytes) or are the only copy of this rank's
    weights (every rank must compute with the same dequantized weights, and this rank's
    fp32 ones cannot also stay exact in the same buffer)."""
    for path, unit in units:
        name = path or "root"
        for group in unit.groups:
            if group.compute_dtype not in CODED_DTYPES:
                raise ValueError(
                    f"quantize_communication(weights=...): unit {name!r} gathers its weights "
                    f"as {group.compute_dtype} (float8 weights travel as bytes, already one a "
                    "value), which block quantization cannot code. Quantize the weights of "
                    "the other units only (call it on those submodules) or pass weights=None"
                )
            if group.gathers_into_its_only_copy:
                raise ValueError(
                    f"quantize_communication(weights=...): unit {name!r} keeps its weights "
                    "whole (zero_dp_strategy 'optim' or 'optim_grads') with no main weights "
                    "apart, so its gathered weights are the ones the optimizer steps and int8 "
                    "would overwrite them every step. Shard the weights "
                    "(zero_dp_strategy='optim_grads_params'), keep fp32 main weights apart "
                    "(MixedPrecisionPolicy(param_dtype=torch.bfloat16)), or quantize only the "
                    "gradients (weights=None)"
                )


def _one_dim_ranges(unit: FSDPUnit) -> dict[int, list[tuple[int, int]]]:
    """Where the unit's 1-D parameters (norms, biases) sit in each of its groups' unsharded
    flat buffers, keyed by the buffer's size (the comm learns which group calls it from
    that; two groups of one size share the union, which only carries more values exactly)."""
    ranges: dict[int, list[tuple[int, int]]] = {}
    for group in unit.groups:
        layout = group.layout
        ranges.setdefault(layout.padded_numel, []).extend(
            (p.offset, p.offset + p.numel) for p in layout.placements if len(p.shape) <= 1
        )
    return {numel: found for numel, found in ranges.items() if found}
