"""Argument checks shared by the ops: a bad argument that reaches a collective on one rank
hangs the others, so each op checks locally first and names the argument and the fix."""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from mfsdp_buffers import FlatPieces

__all__ = [
    "check_dtype",
    "check_flat",
    "check_group",
    "check_same_device",
    "check_scale",
    "overlaps",
]


def check_flat(t: object, arg: str) -> torch.Tensor:
    """``t`` must be a 1-D contiguous tensor: the ops work on flat buffers."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{arg} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != 1:
        raise ValueError(
            f"{arg} must be a 1-D flat buffer, got shape {tuple(t.shape)}; pass {arg}.view(-1)"
        )
    if not t.is_contiguous():
        raise ValueError(f"{arg} must be contiguous; pass {arg}.contiguous()")
    return t


def check_group(group: object, arg: str = "group") -> dist.ProcessGroup:
    if not isinstance(group, dist.ProcessGroup):
        raise TypeError(
            f"{arg} must be a torch.distributed.ProcessGroup, got {type(group).__name__}; "
            "take it from FSDPTopology (e.g. topology.shard_group)"
        )
    return group


def check_same_device(
    a: torch.Tensor | FlatPieces, a_arg: str, b: torch.Tensor, b_arg: str
) -> None:
    if a.device != b.device:
        raise ValueError(
            f"{a_arg} is on {a.device} but {b_arg} is on {b.device}; move both to one device"
        )


def check_dtype(dtype: object, arg: str) -> torch.dtype | None:
    if dtype is None:
        return None
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"{arg} must be a torch.dtype or None, got {dtype!r}")
    return dtype


def check_floating(dtype: torch.dtype, arg: str, why: str) -> None:
    if not dtype.is_floating_point:
        raise TypeError(
            f"{arg} has dtype {dtype}, but {why} needs a floating-point dtype; "
            "pass reduce_dtype=torch.float32 or average=False without scaling"
        )


def check_scale(value: object, arg: str) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{arg} must be a float or None, got {type(value).__name__}")
    if not math.isfinite(value) or value == 0:
        raise ValueError(f"{arg} must be finite and non-zero, got {value}; pass None for 1.0")
    return float(value)


def overlaps(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two (contiguous) tensors share any byte of memory: the same storage object
    (fake tensors of a planning run too, whose addresses are all 0) and byte ranges that meet."""
    if a.numel() == 0 or b.numel() == 0 or a.untyped_storage() is not b.untyped_storage():
        return False
    a0, b0 = a.storage_offset() * a.element_size(), b.storage_offset() * b.element_size()
    return a0 < b0 + b.nbytes and b0 < a0 + a.nbytes
