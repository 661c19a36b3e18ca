"""Test-only CPU workarounds for Megatron-Core's pipeline schedules, which assume CUDA.

* Its P2P receive buffers are allocated on ``torch.cuda.current_device()``, which a CPU build
  of torch cannot answer: :func:`point_cuda_device_at_cpu` makes it answer ``"cpu"`` (in a
  test worker process only).
* Its schedules make their token counter with ``device="cuda"``: :class:`CudaOnCpu`, a
  ``TorchFunctionMode`` held around the schedule call, makes such tensors on the CPU.
* Without Transformer Engine, 0.16.1's MoE router raises
  ``NameError: name 'te_general_gemm' is not defined`` (``moe_utils.py`` imports it only
  with TE, then tests ``te_general_gemm is not None``): :func:`define_missing_te_gemm` sets
  the name to None, the value its test means by "no TE", so the router's plain matmul runs.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.overrides import TorchFunctionMode


def point_cuda_device_at_cpu() -> None:
    torch.cuda.current_device = lambda: "cpu"  # type: ignore[assignment,return-value]


def define_missing_te_gemm() -> None:
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


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
