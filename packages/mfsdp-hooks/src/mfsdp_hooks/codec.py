"""How a parameter group's weights travel in its all-gather: the ``ParamCodec`` extension point.

By default a shard is sent as it is (cast to the compute dtype when fp32 main weights
exist) and the gathered buffer *is* the compute weights. A codec changes both ends, the
shape FSDP2 gives its tensor-subclass protocol: ``encode`` is ``fsdp_pre_all_gather`` (what
this rank contributes, computed from its optimizer-facing shard) and ``decode`` is
``fsdp_post_all_gather`` (the compute weights, rebuilt once everything arrived). FP8
weights plug in here: encode quantises the main shard, decode rebuilds the float8 weight.

A codec reads the optimizer's weights and writes the gather buffer, so it needs main weights
separate from the compute weights (a ``MixedPrecisionPolicy`` whose compute dtype differs
from the main dtype); ``ParameterGroup`` refuses it otherwise.
"""

from __future__ import annotations

from typing import Protocol

import torch

__all__ = ["IDENTITY", "IdentityCodec", "ParamCodec"]


class ParamCodec(Protocol):
    """Encode a shard before the all-gather, decode the gathered buffer after it."""

    @property
    def decodes(self) -> bool:
        """False when the gathered buffer already is the compute weights (no ``decode``)."""
        ...

    def encode(self, source: torch.Tensor, out: torch.Tensor) -> None:
        """Write this rank's all-gather input into ``out`` (its slot of the gather buffer)
        from ``source``, its shard of the main weights."""
        ...

    def decode(self, gathered: torch.Tensor) -> None:
        """Turn the whole gathered buffer into the compute weights, in place."""
        ...


class IdentityCodec:
    """The default: the main shard, cast to the compute dtype, is what travels."""

    decodes = False

    def encode(self, source: torch.Tensor, out: torch.Tensor) -> None:
        out.copy_(source)

    def decode(self, gathered: torch.Tensor) -> None:
        """Nothing to do: the gathered buffer is the compute weights."""


IDENTITY = IdentityCodec()
