"""Test-only CPU workarounds for Megatron-Core's pipeline schedules, which assume CUDA.

* Its P2P receive buffers are allocated on ``torch.cuda.current_device()``, which a CPU build
  of torch cannot answer: :func:`point_cuda_device_at_cpu` makes it answer ``"cpu"`` (in a
  test worker process only).
* Its schedules make their token counter with ``device="cuda"``: :class:`CudaOnCpu`, a
  ``TorchFunctionMode`` held around the schedule call, makes such tensors on the CPU.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.overrides import TorchFunctionMode


def point_cuda_device_at_cpu() -> None:
    torch.cuda.current_device = lambda: "cpu"  # type: ignore[assignment,return-value]


class CudaOnCpu(TorchFunctionMode):
    """Factory calls that name ``device="cuda"`` make CPU tensors instead."""

    def __torch_function__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None
    ) -> Any:
        kwargs = dict(kwargs or {})
        device = kwargs.get("device")
        if device is not None and torch.device(device).type == "cuda":
            kwargs["device"] = "cpu"
        return func(*args, **kwargs)
