"""torchao float8 weights in the engine: FSDP2's tensor-subclass protocol over flat buffers.

:class:`TorchaoFloat8Codec` claims torchao's ``WeightWithDynamicFloat8CastTensor`` weights;
how a group of them is encoded, gathered and decoded: the package README, "How data flows
through it". The scales are torchao's (``amax_to_scale``) from one all-reduce (MAX) per
group, as its ``precompute_float8_dynamic_scale_for_fsdp`` computes them. The subclass is
read only through the public tensor-subclass protocol (``__tensor_flatten__``), its
constructor and the FSDP2 hooks.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from mfsdp_hooks import CodecContext

__all__ = ["Float8GroupCodec", "TorchaoFloat8Codec", "torchao_float8_available"]


@functools.cache
def _weight_class() -> type[torch.Tensor] | None:
    try:
        from torchao.float8.fsdp_utils import WeightWithDynamicFloat8CastTensor
    except ImportError:
        return None
    weight_class: type[torch.Tensor] = WeightWithDynamicFloat8CastTensor
    return weight_class


def torchao_float8_available() -> bool:
    """Whether torchao's float8 training (and so this codec) can be used here."""
    return _weight_class() is not None


class TorchaoFloat8Codec:
    """Claims torchao's ``WeightWithDynamicFloat8CastTensor`` weights (tensorwise scaling)."""

    name = "torchao-float8"
    wire_dtype = torch.uint8  # Float8GroupCodec's

    def claims(self, param: torch.Tensor) -> bool:
        if not type(param).__module__.startswith("torchao."):
            return False  # without importing torchao (slow, and noisy without CUDA)
        weight_class = _weight_class()
        return weight_class is not None and isinstance(param, weight_class)

    def bind(self, params: Sequence[nn.Parameter], context: CodecContext) -> Float8GroupCodec:
        return Float8GroupCodec(params, context)


class _Weight:
    """What the codec keeps of one claimed weight: how to rebuild the subclass around a
    tensor (its flatten context), and its high-precision value until the buffers hold it."""

    def __init__(self, param: torch.Tensor) -> None:
        inner, self.context = param.__tensor_flatten__()  # type: ignore[attr-defined]
        if len(inner) != 1:
            raise NotImplementedError(
                f"a {type(param).__name__} with inner tensors {inner} (a precomputed scale?): "
                "the engine computes float8 scales itself; do not call "
                "precompute_float8_dynamic_scale_for_fsdp on a model megatron-fsdp shards"
            )
        self.inner_name = inner[0]
        self.cls = type(param)
        self.high_precision: torch.Tensor | None = getattr(param, self.inner_name)
        self.requires_grad = param.requires_grad
        self.float8_dtype: torch.dtype = self.context["dtype"]

    def around(self, tensor: torch.Tensor, scale: torch.Tensor | None = None) -> Any:
        """The subclass over ``tensor`` with a precomputed ``scale`` (torchao's constructor:
        the tensor, its matmul config, the float8 dtype, the scale)."""
        return self.cls(tensor, self.context["mm_config"], self.float8_dtype, scale)


class Float8GroupCodec:
    """The codec of one group of torchao float8 weights (see the module docstring)."""

    decodes = True
    wire_dtype = TorchaoFloat8Codec.wire_dtype

    def __init__(self, params: Sequence[nn.Parameter], context: CodecContext) -> None:
        self._context = context
        self._weights = [_Weight(p) for p in params]
        # Per weight, made once: its unsharded parameter, the protocol object that hands it a
        # new scale, and its float8 bytes in the gathered buffer (whose storage is stable).
        self._decoding: list[tuple[nn.Parameter, Any, torch.Tensor]] = []
        device = params[0].device
        self._scales = torch.ones(len(params), dtype=torch.float32, device=device)

    def high_precision(self, index: int) -> torch.Tensor:
        value = self._weights[index].high_precision
        assert value is not None, "read once, before the buffers are filled"
        return value

    def unsharded_param(self, index: int, view: torch.Tensor) -> nn.Parameter:
        weight = self._weights[index]
        weight.high_precision = None  # the main buffer holds it now
        data = view.view(weight.float8_dtype)
        protocol = weight.around(data.new_empty(0, dtype=self._context.compute_dtype))
        scale = self._scales[index]
        unsharded, _ = protocol.fsdp_post_all_gather((data,), (scale,), self._context.compute_dtype)
        param = nn.Parameter(unsharded, requires_grad=weight.requires_grad)
        self._decoding.append((param, protocol, data))
        return param

    # ------------------------------------------------------------------ the protocol
    def _pieces(self, source: torch.Tensor) -> list[tuple[int, int]]:
        """Each weight's ``(offset, numel)`` in ``source``: this rank's shard of the main
        weights, or all of them (``no_shard``, or one rank)."""
        layout = self._context.layout
        if source.numel() == layout.padded_numel:
            return [(p.offset, p.numel) for p in layout.placements]
        assert source.numel() == layout.shard_numel, "a shard or the whole buffer"
        pieces = (
            layout.local_piece(i, self._context.shard_rank) for i in range(len(self._weights))
        )
        return [(piece.shard_offset, piece.numel) for piece in pieces]

    def encode(self, source: torch.Tensor, out: torch.Tensor) -> None:
        from torchao.float8.float8_utils import amax_to_scale

        pieces = self._pieces(source)
        amax = torch.zeros(len(pieces), dtype=torch.float32, device=source.device)
        for index, (offset, numel) in enumerate(pieces):
            if numel:
                amax[index] = source[offset : offset + numel].abs().max()
        whole = source.numel() == self._context.layout.padded_numel
        if self._context.shard_group is not None and not whole:
            dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=self._context.shard_group)
        for index, (weight, (offset, numel)) in enumerate(zip(self._weights, pieces, strict=True)):
            self._scales[index] = amax_to_scale(amax[index], weight.float8_dtype)
            if not numel:
                continue
            rows = source[offset : offset + numel]
            protocol = weight.around(rows, self._scales[index].clone())
            (data,), _ = protocol.fsdp_pre_all_gather(None)
            out[offset : offset + numel].view(weight.float8_dtype).copy_(data.view(-1))

    def decode(self, gathered: torch.Tensor) -> None:
        del gathered  # each weight's bytes were viewed once, at unsharded_param
        dtype = self._context.compute_dtype
        for index, (param, protocol, data) in enumerate(self._decoding):
            scale = self._scales[index].clone()  # its own: forward may save it for backward
            protocol.fsdp_post_all_gather((data,), (scale,), dtype, out=param)
