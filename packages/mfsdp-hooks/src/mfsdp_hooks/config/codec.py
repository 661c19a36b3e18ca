"""How a parameter group's weights travel in its all-gather: the ``ParamCodec`` extension point
(``fully_shard(param_codec=...)``) and the per-class ``ParamClassCodec``
(``fully_shard(param_codecs=[...])``), FSDP2's tensor-subclass protocol over flat buffers; the
package README's "Extension point" walks through both. ``mfsdp_te`` implements them; this
layer never imports it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.distributed as dist
from torch import nn

from mfsdp_buffers import FlatLayout

__all__ = [
    "IDENTITY",
    "CodecContext",
    "GroupCodec",
    "IdentityCodec",
    "ParamClassCodec",
    "ParamCodec",
]


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


@dataclass(frozen=True)
class CodecContext:
    """What a codec bound to one parameter group knows about it."""

    layout: FlatLayout
    """The compute cut: the gathered buffer holds every parameter at its layout offset."""
    shard_rank: int
    shard_group: dist.ProcessGroup | None
    """The group the weights are gathered over (scales agree over it); None on one rank."""
    compute_dtype: torch.dtype
    """The dtype forward computes in (a float8 weight's high-precision dtype)."""


class GroupCodec(ParamCodec, Protocol):
    """A ``ParamCodec`` bound to the parameters of one group, which it also describes."""

    @property
    def wire_dtype(self) -> torch.dtype:
        """The dtype of the compute buffer, what the all-gather moves."""
        ...

    def high_precision(self, index: int) -> torch.Tensor:
        """Parameter ``index``'s value in high precision: where its main weights start."""
        ...

    def unsharded_param(self, index: int, view: torch.Tensor) -> nn.Parameter:
        """The parameter forward sees for ``index``, built over ``view`` (its bytes in the
        unsharded compute buffer, which keeps its storage across reshards)."""
        ...


class ParamClassCodec(Protocol):
    """Claims the parameters of some tensor-subclass classes and binds to their groups."""

    @property
    def name(self) -> str:
        """Short and the same on every rank: part of the group's bucket key."""
        ...

    @property
    def wire_dtype(self) -> torch.dtype:
        """What its groups' compute buffers hold and all-gathers move (its bound codecs'
        ``wire_dtype``): a planner sizes the buffers from it before anything is bound."""
        ...

    def claims(self, param: torch.Tensor) -> bool:
        """Whether this codec handles ``param`` (the same answer on every rank)."""
        ...

    def bind(self, params: Sequence[nn.Parameter], context: CodecContext) -> GroupCodec:
        """A codec for one group of claimed parameters (in layout order)."""
        ...
