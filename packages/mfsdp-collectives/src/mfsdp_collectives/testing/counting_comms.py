"""Custom comms in FSDP2's protocol that count what they were asked (calls, allocated sizes,
reduce ops), for tests that drive ``set_custom_all_gather``/``set_custom_reduce_scatter`` on
our units and FSDP2's side by side (torch does not export its own publicly).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from ..comms.custom_comms import EmptyBuffers
from ..core._compat import Work, all_gather_single, reduce_scatter_single

__all__ = ["CountingAllGather", "CountingReduceScatter", "GradientRecorder"]


class _CountedBuffers(EmptyBuffers):
    """``allocate`` as FSDP2's default (``torch.empty``), every size remembered."""

    def __init__(self) -> None:
        self.calls = 0
        self.allocated: list[tuple[int, ...]] = []

    def allocate(
        self, size: Sequence[int], *, dtype: torch.dtype, device: torch.device
    ) -> torch.Tensor:
        self.allocated.append(tuple(int(s) for s in size))
        return super().allocate(size, dtype=dtype, device=device)


class CountingAllGather(_CountedBuffers):
    """c10d's all-gather, counted: every call, the size of the group it gathered over, and
    every buffer it allocated."""

    def __init__(self) -> None:
        super().__init__()
        self.group_sizes: list[int] = []

    def __call__(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: dist.ProcessGroup,
        async_op: bool = False,
    ) -> Work | None:
        self.calls += 1
        self.group_sizes.append(dist.get_world_size(group))
        return all_gather_single(output_tensor, input_tensor, group, async_op=async_op)


class CountingReduceScatter(_CountedBuffers):
    """c10d's reduce-scatter, counted, optionally in a lower precision on the wire
    (``wire_dtype``: VeOmni's and torchft's kind of hook; cast in, reduced, cast back)."""

    def __init__(self, wire_dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.wire_dtype = wire_dtype
        self.ops: list[str] = []

    def __call__(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: dist.ProcessGroup,
        op: dist.ReduceOp.RedOpType,
        async_op: bool = False,
    ) -> Work | None:
        self.calls += 1
        self.ops.append(str(op))
        if self.wire_dtype is None or self.wire_dtype == input_tensor.dtype:
            return reduce_scatter_single(output_tensor, input_tensor, op, group, async_op=async_op)
        wire_out = output_tensor.new_empty(output_tensor.shape, dtype=self.wire_dtype)
        reduce_scatter_single(wire_out, input_tensor.to(self.wire_dtype), op, group, async_op=False)
        output_tensor.copy_(wire_out)
        return None


class GradientRecorder:
    """An all-reduce hook that scales what it sees in place and records its sums."""

    def __init__(self, scale: float = 1.0) -> None:
        self.scale = scale
        self.sums: list[float] = []

    def __call__(self, reduced: torch.Tensor) -> None:
        self.sums.append(float(reduced.sum()))
        if self.scale != 1.0:
            reduced.mul_(self.scale)
