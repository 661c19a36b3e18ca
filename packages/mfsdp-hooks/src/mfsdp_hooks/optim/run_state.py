"""How per-parameter optimizer state maps onto the contiguous stepper's flat runs: pure
functions of tensors (``optimizer.state[p]`` holds views into a run's flat buffers and the
run's shared step counter); the stepper (``contiguous_step``) owns when they run.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.tensor import DTensor

from mfsdp_hooks.dtensor.dtensor_views import dtensor_like, local_tensor

__all__ = ["counters_per_parameter", "flat_over", "split_state", "tensor_entries", "view_like"]


def flat_over(locals_: list[torch.Tensor]) -> torch.Tensor | None:
    """One 1-D view over tensors that tile one storage back to back, else None."""
    nonempty = [t for t in locals_ if t.numel()]
    if not nonempty:
        return None
    first = nonempty[0]
    # The storage object, not its address: fake tensors (a planning run) all have address 0.
    storage = first.untyped_storage()
    cursor = first.storage_offset()
    for tensor in nonempty:
        if (
            tensor.dtype != first.dtype
            or tensor.device != first.device
            or not tensor.is_contiguous()
            or tensor.untyped_storage() is not storage
            or tensor.storage_offset() != cursor
        ):
            return None
        cursor += tensor.numel()
    return first.as_strided((cursor - first.storage_offset(),), (1,), first.storage_offset())


def view_like(flat: torch.Tensor, param: torch.Tensor, offset: int) -> torch.Tensor:
    """``flat[offset:]`` viewed as ``param``'s local piece, wrapped like ``param``."""
    local = local_tensor(param)
    if local.numel():
        piece = flat[offset : offset + local.numel()].view(local.shape)
    else:  # a view at the storage's end confuses deepcopy's storage memo; nothing to share
        piece = flat.new_empty(local.shape)
    return dtensor_like(piece, param) if isinstance(param, DTensor) else piece


def split_state(
    values_by_key: dict[str, list[torch.Tensor]], shapes: list[torch.Size]
) -> tuple[dict[str, list[torch.Tensor]], dict[str, torch.Tensor]] | None:
    """Sort state entries into elementwise ones (shaped like their tensor) and shared
    scalars (one equal value everywhere); None when an entry is neither."""
    elementwise: dict[str, list[torch.Tensor]] = {}
    scalars: dict[str, torch.Tensor] = {}
    for key, values in values_by_key.items():
        if all(value.shape == shape for value, shape in zip(values, shapes, strict=True)):
            elementwise[key] = values
        elif all(value.numel() == 1 and torch.equal(value, values[0]) for value in values):
            scalars[key] = values[0]
        else:
            return None
    return elementwise, scalars


def tensor_entries(entries: list[dict[str, Any]]) -> dict[str, list[torch.Tensor]] | None:
    """Per key, every entry's tensor; None unless all entries hold the same tensor keys.

    Keys keep the first entry's order, the order torch's step created them in, which is the
    same on every rank. A full state dict gathers state key by key in this order, so an
    order that differed between ranks (a set's: strings hash per process) would pair one
    rank's ``exp_avg`` with another's ``exp_avg_sq``.
    """
    by_key: dict[str, list[torch.Tensor]] = {key: [] for key in entries[0]}
    for entry in entries:
        if entry.keys() != by_key.keys():
            return None
        for key, value in entry.items():
            if not isinstance(value, torch.Tensor):
                return None
            by_key[key].append(local_tensor(value))
    return by_key


def counters_per_parameter(
    optimizer: torch.optim.Optimizer, state_dict: dict[str, Any]
) -> dict[str, Any]:
    """The state dict with a counter of its own in every parameter's entry.

    A run's parameters share one step counter in ``optimizer.state``; torch's per-parameter
    loop, or a stepper whose runs are cut elsewhere, would count a shared one once per
    parameter. The live entries are left as they are.
    """
    seen: set[int] = set()
    state: dict[Any, Any] = {}
    for key, entry in state_dict["state"].items():
        tensors = {k: v for k, v in entry.items() if isinstance(v, torch.Tensor)}
        shared = [k for k, v in tensors.items() if id(v) in seen]
        seen.update(id(v) for v in tensors.values())
        state[key] = {**entry, **{k: entry[k].clone() for k in shared}} if shared else entry
    return {**state_dict, "state": state}
