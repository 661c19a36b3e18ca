"""How a reduction is carried out: the op, the communicated tensor, the scaling, shared by
reduce-scatter, all-reduce and HSDP so the three agree exactly on
``post_scale * reduce_{sum|avg}(pre_scale * x.to(reduce_dtype))`` and on the rules that keep
it cheap (the package README's "Async collectives on flat buffers").
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..core._checks import check_dtype, check_floating, check_scale
from ..core._compat import supports_avg

__all__ = ["Reduction", "ReduceSpec", "finish_into", "prepare_input", "reduce_op"]


@dataclass(frozen=True)
class ReduceSpec:
    """``post_scale * reduce(pre_scale * x.to(reduce_dtype))``, ``reduce`` the mean over the
    ranks when ``average`` else the sum, ``reduce_dtype`` None the input's. Checked when
    built, so a bad option raises on the calling rank before any collective."""

    average: bool = True
    pre_scale: float | None = None
    post_scale: float | None = None
    reduce_dtype: torch.dtype | None = None
    sum_only: bool = False
    """Carry a mean as a sum and a divide of the output, never ``ReduceOp.AVG`` (FSDP2's
    ``set_force_sum_reduction_for_comms``: NCCL's zero-copy paths need SUM). The result is
    the same; only the op on the wire changes."""

    def __post_init__(self) -> None:
        for name in ("average", "sum_only"):
            value = getattr(self, name)
            if not isinstance(value, bool):
                raise TypeError(f"{name} must be a bool, got {type(value).__name__}")
        object.__setattr__(self, "pre_scale", check_scale(self.pre_scale, "pre_scale"))
        object.__setattr__(self, "post_scale", check_scale(self.post_scale, "post_scale"))
        check_dtype(self.reduce_dtype, "reduce_dtype")

    def resolve(self, dtype: torch.dtype, arg: str) -> Reduction:
        """This spec for an input of ``dtype`` (named ``arg`` in errors)."""
        reduction = Reduction(
            self.average, self.pre_scale, self.post_scale, self.reduce_dtype or dtype, self.sum_only
        )
        if self.average or self.pre_scale is not None or self.post_scale is not None:
            check_floating(
                reduction.reduce_dtype,
                "reduce_dtype" if self.reduce_dtype is not None else arg,
                "averaging or scaling",
            )
        return reduction


@dataclass(frozen=True)
class Reduction:
    """A ``ReduceSpec`` resolved for one call's input: the dtype that travels is known."""

    average: bool
    pre_scale: float | None
    post_scale: float | None
    reduce_dtype: torch.dtype
    sum_only: bool = False


def reduce_op(
    group: dist.ProcessGroup, average: bool, *, sum_only: bool = False
) -> tuple[dist.ReduceOp.RedOpType, float]:
    """The op to issue on ``group`` and the factor still owed to the output: ``1/size`` when
    averaging on a backend without AVG (or ``sum_only``), else 1."""
    if not average:
        return dist.ReduceOp.SUM, 1.0
    if supports_avg(group) and not sum_only:
        return dist.ReduceOp.AVG, 1.0
    return dist.ReduceOp.SUM, 1.0 / dist.get_world_size(group)


def prepare_input(x: torch.Tensor, spec: Reduction) -> torch.Tensor:
    """The tensor to send: ``x`` itself when possible, else one scaled/cast copy."""
    if x.dtype != spec.reduce_dtype:
        y = x.to(spec.reduce_dtype)
        if spec.pre_scale is not None:
            y.mul_(spec.pre_scale)
        return y
    if spec.pre_scale is not None:
        return torch.mul(x, spec.pre_scale)
    return x


def finish_into(
    result: torch.Tensor, out: torch.Tensor, *, factor: float, accumulate: bool
) -> None:
    """Apply the remaining ``factor`` and store (or add) ``result`` (maybe ``out`` itself)
    into ``out``. Accumulation adds in the wider dtype and rounds once, into ``out``'s."""
    if result is out:
        if factor != 1.0:
            out.mul_(factor)
        return
    if accumulate:
        if factor != 1.0:
            out.add_(result, alpha=factor)
        else:
            out.add_(result)
        return
    if factor != 1.0:
        result.mul_(factor)
    out.copy_(result)
