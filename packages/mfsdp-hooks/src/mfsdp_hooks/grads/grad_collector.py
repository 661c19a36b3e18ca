"""What one backward collected of a parameter group's unsharded gradients.

Autograd delivers each parameter's gradient separately, possibly several times (a weight used
twice, recomputation). A ``GradCollector`` either holds autograd's tensors and hands the
reduction ``FlatPieces`` (the shared-memory transport reads them in place, no copy), or adds
each into one flat buffer in the reduce dtype from the allocator, the pre-scale riding on
that copy. ``clear`` (after the reduction landed) drops what was held or gives the buffer back.
"""

from __future__ import annotations

import torch

from mfsdp_buffers import Allocator, FlatLayout, FlatPieces, allocate_checked, release_to

__all__ = ["GradCollector"]


class GradCollector:
    """One group's unsharded gradients of the current backward (and ``no_sync`` ones)."""

    def __init__(
        self,
        layout: FlatLayout,
        *,
        reduce_dtype: torch.dtype,
        device: torch.device,
        allocator: Allocator,
        hold: bool,
    ) -> None:
        self.layout = layout
        self.reduce_dtype = reduce_dtype
        self._device = device
        self._allocator = allocator
        self.input_scale: float | None = None  # the reducer's ``configure`` sets it
        count = len(layout.placements)
        self.expected = count
        self.received = 0
        self._held: list[torch.Tensor | None] | None = [None] * count if hold else None
        self._gaps = layout.padding_gaps()
        self._buffer: torch.Tensor | None = None
        self._filled = [False] * count

    def begin_backward(self) -> None:
        self.received = 0

    @property
    def all_received(self) -> bool:
        return self.received >= self.expected

    def accumulate(self, index: int, grad: torch.Tensor) -> bool:
        """Take one parameter's unsharded gradient; True once every gradient of the group
        arrived in this backward. No reduction of them may be in flight (the caller's check)."""
        flat = self.layout.placements[index].flatten(grad)  # storage order
        if self._held is not None:
            self._hold(index, flat)
        else:
            self._copy_in(index, flat)
        self.received += 1
        return self.all_received

    def _hold(self, index: int, flat_grad: torch.Tensor) -> None:
        assert self._held is not None
        held = self._held[index]
        if held is None:
            self._held[index] = flat_grad
            return
        if held.dtype != self.reduce_dtype:
            held = held.to(self.reduce_dtype)
        with torch.no_grad():
            self._held[index] = held.add_(flat_grad)

    def _allocate(self) -> torch.Tensor:
        if self._buffer is None:
            self._buffer = allocate_checked(
                self._allocator,
                ("grad", id(self)),
                self.layout.padded_numel,
                self.reduce_dtype,
                self._device,
            )
        return self._buffer

    def _copy_in(self, index: int, flat_grad: torch.Tensor) -> None:
        placement = self.layout.placements[index]
        slot = self._allocate()[placement.offset : placement.offset + placement.numel]
        scale = self.input_scale
        with torch.no_grad():
            # A pre-scale (1/N, gradient_scaling_factor) rides on the copy we make anyway,
            # instead of a separate scaled copy of the whole bucket before the collective.
            if self._filled[index]:
                slot.add_(flat_grad, alpha=1.0 if scale is None else scale)
            elif scale is None:
                slot.copy_(flat_grad)
            else:
                torch.mul(flat_grad, scale, out=slot)
            self._filled[index] = True

    def presence(self) -> list[bool]:
        """Per parameter: whether this rank collected a gradient for it since the last
        ``clear`` (this backward's and ``no_sync``'s)."""
        if self._held is not None:
            return [g is not None for g in self._held]
        return list(self._filled)

    @property
    def has_grads(self) -> bool:
        if self._held is not None:
            return any(g is not None for g in self._held)
        return self._buffer is not None

    def collected(self) -> torch.Tensor | FlatPieces:
        """What was collected, as a reduction reads it (padding and missing gradients 0)."""
        if self._held is not None:
            placements = self.layout.placements
            return FlatPieces(
                self.layout.padded_numel,
                [(placements[i].offset, g) for i, g in enumerate(self._held) if g is not None],
                dtype=self.reduce_dtype,
                device=self._device,
            )
        buffer = self._allocate()
        with torch.no_grad():
            for start, end in self._gaps:
                buffer[start:end].zero_()
            for index, filled in enumerate(self._filled):
                if not filled:
                    placement = self.layout.placements[index]
                    buffer[placement.offset : placement.offset + placement.numel].zero_()
        return buffer

    def clear(self, move_into: tuple[torch.Tensor, bool] | None = None) -> None:
        """Forget what was collected, once its reduction landed; ``move_into`` (a target and
        whether to add to it) first takes the buffer's content (``no_shard``'s all-reduce
        happened in place in it)."""
        if self._held is not None:
            self._held = [None] * len(self._filled)
            return
        buffer = self._buffer
        assert buffer is not None
        if move_into is not None:
            target, accumulate = move_into
            with torch.no_grad():
                if accumulate:
                    target.add_(buffer)
                else:
                    target.copy_(buffer)
        release_to(self._allocator, ("grad", id(self)), buffer)
        self._buffer = None
        self._filled = [False] * len(self._filled)
