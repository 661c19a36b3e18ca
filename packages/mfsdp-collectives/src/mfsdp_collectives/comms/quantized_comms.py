"""The quantized collectives as comms of FSDP2's protocol (``set_custom_reduce_scatter``,
``set_custom_all_gather``): what ``mfsdp_hooks.quantize_communication`` sets on each unit.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
import torch.distributed as dist

from ..core._compat import Work, all_gather_single, backend_name, reduce_scatter_single
from ..host.collective_worker import CollectiveWorker
from .block_codec import BlockQuantization
from .custom_comms import EmptyBuffers
from .exact_values import ExactPositions
from .quantization_buffers import QuantizationBuffers
from .quantization_errors import QuantizationErrorLog
from .quantized import ErrorReport, quantized_all_gather_into, quantized_reduce_scatter_into

__all__ = ["QuantizedAllGather", "QuantizedReduceScatter"]


class _QuantizedComm(EmptyBuffers):
    """FSDP2's comm protocol over the quantized collectives; ``min_numel``: a chunk smaller
    than this (a tiny unit: norms, biases) travels in full precision, where the scales'
    bytes and the error would buy nothing. One comm may serve many units: its
    ``QuantizationBuffers`` are then shared, which bounds their memory, and so may its
    ``CollectiveWorker`` (``worker``). ``background`` (default: on gloo groups): an async
    call quantizes, exchanges and sums (or dequantizes) on that worker's thread; off, on the
    calling thread. ``error_log``: each call's relative quantization error is recorded
    there under ``name`` (the bucket: a unit's name) and the op. ``exact``: for a flat
    buffer of a given size (unsharded), the ``[start, stop)`` ranges carried in fp32 beside
    the codes (the 1-D parameters of the unit whose buffer has that size)."""

    op_name = ""
    uses_caller_buffers = True  # allocate is EmptyBuffers': the engine's buffers serve
    regathers_exactly = False  # a second pass over dequantized values rounds them again

    def __init__(
        self,
        spec: BlockQuantization | None = None,
        *,
        min_numel: int | None = None,
        buffers: QuantizationBuffers | None = None,
        background: bool | None = None,
        worker: CollectiveWorker | None = None,
        error_log: QuantizationErrorLog | None = None,
        name: str = "",
        exact: Mapping[int, Sequence[tuple[int, int]]] | None = None,
    ) -> None:
        if background is not None and not isinstance(background, bool):
            raise TypeError(f"background={background!r} must be True, False or None (gloo)")
        if error_log is not None and not isinstance(error_log, QuantizationErrorLog):
            raise TypeError(f"error_log must be a QuantizationErrorLog or None, got {error_log!r}")
        self.spec = spec if spec is not None else BlockQuantization()
        self.min_numel = self.spec.block if min_numel is None else min_numel
        self.buffers = buffers if buffers is not None else QuantizationBuffers()
        self.background = background
        self._worker = worker
        self.error_log, self.name = error_log, name
        self.exact = dict(exact or {})
        self._positions: dict[tuple[int, int], ExactPositions] = {}

    def _exact_for(self, numel: int, group: dist.ProcessGroup) -> ExactPositions | None:
        """The exact positions of a buffer of ``numel`` values over ``group`` (cached)."""
        ranges = self.exact.get(numel)
        if not ranges:
            return None
        key = (numel, dist.get_world_size(group))
        if key not in self._positions:
            self._positions[key] = ExactPositions(ranges, *key)
        return self._positions[key]

    def _report(self) -> ErrorReport | None:
        log = self.error_log
        if log is None:
            return None
        bucket = f"{self.name or type(self).__name__} {self.op_name}"
        return lambda sums, numel: log.record(bucket, sums, numel)

    def _worker_for(self, group: dist.ProcessGroup, async_op: bool) -> CollectiveWorker | None:
        """This comm's worker when the call runs in the background (async, and ``background``
        or, by default, a gloo group), else None."""
        wanted = self.background if self.background is not None else backend_name(group) == "gloo"
        if not (wanted and async_op):
            return None
        if self._worker is None:
            self._worker = CollectiveWorker()
        return self._worker


class QuantizedReduceScatter(_QuantizedComm):
    """A reduce-scatter comm (``FSDPModule.set_custom_reduce_scatter``) that carries the
    gradients block-quantized: ``quantized_reduce_scatter_into``. Without the worker the
    training thread quantizes and sums and only the exchange is in flight."""

    op_name = "reduce_scatter"

    def __call__(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: dist.ProcessGroup,
        op: dist.ReduceOp.RedOpType,
        async_op: bool = False,
    ) -> Work | None:
        if op not in (dist.ReduceOp.SUM, dist.ReduceOp.AVG):
            raise ValueError(f"a quantized reduce-scatter sums or averages, not {op}")
        if output_tensor.numel() < self.min_numel:
            return reduce_scatter_single(output_tensor, input_tensor, op, group, async_op)
        average = op == dist.ReduceOp.AVG
        return quantized_reduce_scatter_into(
            input_tensor,
            output_tensor,
            group,
            self.spec,
            average=average,
            async_op=async_op,
            buffers=self.buffers,
            worker=self._worker_for(group, async_op),
            report=self._report(),
            exact=self._exact_for(input_tensor.numel(), group),
        )


class QuantizedAllGather(_QuantizedComm):
    """An all-gather comm (``FSDPModule.set_custom_all_gather``) that carries the weights
    block-quantized: ``quantized_all_gather_into``."""

    op_name = "all_gather"

    def __call__(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: dist.ProcessGroup,
        async_op: bool = False,
    ) -> Work | None:
        if input_tensor.numel() < self.min_numel:
            return all_gather_single(output_tensor, input_tensor, group, async_op)
        return quantized_all_gather_into(
            input_tensor,
            output_tensor,
            group,
            self.spec,
            async_op=async_op,
            buffers=self.buffers,
            worker=self._worker_for(group, async_op),
            report=self._report(),
            exact=self._exact_for(output_tensor.numel(), group),
        )
