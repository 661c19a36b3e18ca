"""A unit's gathered weights resharded onto a smaller group between forward and backward.

FSDP2's ``reshard_after_forward=<int>``: after forward this rank keeps its ``1/size`` slice of
the gathered (compute-dtype, or a codec's wire) buffer; the backward unshard puts it back and
all-gathers over the ``size`` ranks of ``PostForwardGroup`` only. A custom all-gather comm runs
that gather, as FSDP2's does, unless it cannot regather its own output exactly
(``regathers_exactly``: block quantization): the slices are what it delivered in forward,
and backward must compute with the same weights. The slice is dropped once the buffer is
rebuilt from it, or when the weights change first (a step, a load): then the next unshard
gathers over the whole shard group.
"""

from __future__ import annotations

import torch

from mfsdp_collectives import AllGatherComm, CommHandle, CommStreams, Route, regathers_exactly

__all__ = ["PostForwardShard"]


class PostForwardShard:
    """This rank's slice of one group's gathered weights, held from forward to backward."""

    def __init__(self, gathered: torch.Tensor, subgroup: Route) -> None:
        """``subgroup``: the route of the ``PostForwardGroup`` (its group and transport)."""
        self.subgroup = subgroup
        with torch.no_grad():
            self._slice: torch.Tensor | None = self._slot(gathered).clone()

    @property
    def numel(self) -> int:
        """Elements held (0 once given back)."""
        return 0 if self._slice is None else self._slice.numel()

    def _slot(self, buffer: torch.Tensor) -> torch.Tensor:
        share = buffer.numel() // self.subgroup.size
        start = self.subgroup.rank * share
        return buffer[start : start + share]

    def gather_into(
        self, buffer: torch.Tensor, streams: CommStreams | None, comm: AllGatherComm | None
    ) -> CommHandle:
        """Rebuild the whole of ``buffer`` (a fresh unsharded buffer) from the subgroup's
        slices, through ``comm`` (the unit's custom all-gather) where it regathers exactly;
        the slice is given back at once (it lives on in ``buffer``)."""
        held, self._slice = self._slice, None
        assert held is not None, "a post-forward shard is gathered once"
        slot = self._slot(buffer)
        with torch.no_grad():
            slot.copy_(held)
        del held
        through = comm if comm is not None and regathers_exactly(comm) else None
        return self.subgroup.all_gather_into(slot, buffer, stream=streams, comm=through)
