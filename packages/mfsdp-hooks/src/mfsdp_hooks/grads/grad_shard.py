"""The reduced gradients the optimizer reads, owned by the parameters' ``.grad``.

The storage is allocated when a backward first reduces into it and is referenced only by
the ``.grad`` DTensors of the distributed parameters (the group keeps a weak reference), so
``optimizer.zero_grad()`` (``set_to_none=True``) frees it at once, as with plain torch and
FSDP2, instead of keeping a persistent gradient buffer alive through the next forward.

With ``MixedPrecisionPolicy(use_decoupled_grad=True)`` the attribute is ``decoupled_grad``
instead (the reference's name, read by optimizers built for it): this class is the one
place that installs, reads and clears it; ``.grad`` of the distributed parameters then
stays None.
"""

from __future__ import annotations

import dataclasses
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from mfsdp_buffers import FlatLayout, host_side, mark_host, on_host
from mfsdp_hooks.dtensor.dtensor_views import DTensorLayout, local_tensor


@dataclass(frozen=True)
class _GradCut:
    """Parameter ``index``'s gradient: ``flat[start:stop].view(shape)`` laid out as ``layout``."""

    start: int
    stop: int
    shape: torch.Size
    layout: DTensorLayout


class DTensorMaker(Protocol):
    """Builds parameter ``index``'s DTensor over ``local`` (``ShardCuts.dtensor``)."""

    def __call__(self, local: torch.Tensor, index: int, *, sharded: bool) -> torch.Tensor: ...


class GradShard:
    """This rank's reduced gradients of one parameter group, created on demand."""

    def __init__(
        self,
        layout: FlatLayout,
        rank: int,
        *,
        dtype: torch.dtype,
        device: torch.device,
        sharded: bool,
        make_dtensor: DTensorMaker,
        attribute: str = "grad",
        pin_memory: bool = False,
        host: bool = False,
    ) -> None:
        """``pin_memory``: host gradients an accelerator copies into asynchronously.
        ``host``: host offload's gradients, host memory even where the CPU stands in for
        the device (``mfsdp_buffers.residence``)."""
        self.layout = layout
        self.pin_memory, self.host = pin_memory, host
        self.rank = rank
        self.dtype = dtype
        self.device = device
        self.sharded = sharded
        self._make_dtensor = make_dtensor
        self.numel = layout.shard_numel if sharded else layout.padded_numel
        self._storage: weakref.ref[torch.Tensor] | None = None
        self.attribute = attribute
        """The parameter attribute the optimizer reads the gradient from."""
        self._grad_cuts: dict[int, _GradCut] = {}
        """Where each parameter's gradient lies in the flat storage and its DTensor layout,
        from the first one built: later steps rebuild ``.grad`` with one slice, one view
        and one constructor (a backward of many small parameters is host-bound)."""

    @property
    def decoupled(self) -> bool:
        """Whether the gradients are handed over in ``decoupled_grad`` instead of ``.grad``."""
        return self.attribute != "grad"

    def held(self, param: nn.Parameter) -> torch.Tensor | None:
        """The gradient ``param`` holds for the optimizer (its ``.grad`` or ``decoupled_grad``)."""
        value = getattr(param, self.attribute, None)
        return value if isinstance(value, torch.Tensor) else None

    def clear(self, params: Sequence[nn.Parameter], *, set_to_none: bool) -> None:
        """What ``optimizer.zero_grad`` does to ``.grad``, for the decoupled attribute."""
        for param in params:
            if set_to_none:
                setattr(param, self.attribute, None)
            else:
                held = self.held(param)
                if held is not None:
                    with torch.no_grad():
                        held.zero_()

    def drop(self, params: Sequence[nn.Parameter], indices: Sequence[int]) -> None:
        """Leave ``params[i]`` without a gradient for each ``i`` in ``indices`` (no rank
        produced one): torch's optimizers then skip it, as under DDP and FSDP2."""
        for index in indices:
            setattr(params[index], self.attribute, None)

    @property
    def storage(self) -> torch.Tensor | None:
        """The live flat gradient tensor, or None once every ``.grad`` dropped it."""
        return self._storage() if self._storage is not None else None

    def on_host(self, device: torch.device) -> bool:
        """Whether the reduced gradients live on the host while ``device`` computes: their
        flat tensor, or (none yet) where the next one is made."""
        flat = self.storage
        if flat is not None:
            return on_host(flat, device)
        return self.host or host_side(self.device, device)

    def local_rows(self, flat: torch.Tensor, index: int) -> torch.Tensor:
        """Parameter ``index``'s rows on this rank inside ``flat`` (its whole value unsharded)."""
        placement = self.layout.placements[index]
        if not self.sharded:
            return placement.rows_view(flat[placement.offset : placement.end])
        piece = self.layout.local_piece(index, self.rank)
        piece_flat = flat[piece.shard_offset : piece.shard_offset + piece.numel]
        return placement.rows_view(piece_flat, piece.num_rows)

    def _dtensor(self, flat: torch.Tensor, index: int, param: nn.Parameter) -> torch.Tensor:
        cut = self._grad_cuts.get(index)
        if cut is not None:
            local = flat[cut.start : cut.stop].view(cut.shape)
            if cut.layout.fits(local):
                return cut.layout.over(local)
        local = self.local_rows(flat, index)
        tensor = self._make_dtensor(local, index, sharded=self.sharded)
        if not isinstance(tensor, DTensor) or not local.is_contiguous():
            return tensor
        layout = DTensorLayout.of(tensor)
        if isinstance(param, DTensor) and param._spec == tensor._spec:
            # The parameter's own spec object, as FSDP2's gradients have: DTensor compares
            # specs by identity before field by field, in every op of the optimizer step.
            layout = dataclasses.replace(layout, spec=param._spec)
        start = int(local.storage_offset() - flat.storage_offset())
        self._grad_cuts[index] = _GradCut(start, start + local.numel(), local.shape, layout)
        return layout.over(local)

    def new_flat(self, numel: int) -> torch.Tensor:
        """An uninitialised flat tensor of the gradients' dtype and device."""
        flat = torch.empty(numel, dtype=self.dtype, device=self.device, pin_memory=self.pin_memory)
        return mark_host(flat) if self.host else flat

    def prepare(self, params: Sequence[nn.Parameter]) -> tuple[torch.Tensor, bool]:
        """The flat tensor the next reduction writes into, and whether it must add to it.

        Torch's rule: gradients the user kept are added to; cleared ones start afresh. The
        parameters' ``.grad`` are pointed at the returned storage before it is filled.
        """
        present = [self.held(p) is not None for p in params]
        current = self.storage
        if current is not None and all(present):
            return current, True
        if current is None and not any(present):
            flat = self.new_flat(self.numel)
            self._install(flat, params, range(len(params)))
            return flat, False
        # Some gradients were cleared, or replaced by tensors of the user's: rebuild one
        # storage that holds what is kept and zeros elsewhere, then add into it.
        flat = self.new_flat(self.numel).zero_()
        with torch.no_grad():
            for index, param in enumerate(params):
                kept = self.held(param)
                if kept is not None:
                    self.local_rows(flat, index).copy_(local_tensor(kept))
        self._install(flat, params, range(len(params)))
        return flat, True

    def _install(self, flat: torch.Tensor, params: Sequence[nn.Parameter], which: range) -> None:
        for index in which:
            setattr(params[index], self.attribute, self._dtensor(flat, index, params[index]))
        self._storage = weakref.ref(flat)

    def zero_(self) -> None:
        flat = self.storage
        if flat is not None:
            with torch.no_grad():
                flat.zero_()

    def nonfinite_flags(self) -> torch.Tensor:
        """One flag per parameter: 1 when its local reduced gradient holds NaN or Inf."""
        count = len(self.layout.placements)
        flags = torch.zeros(count, dtype=torch.float32, device=self.device)
        flat = self.storage
        if flat is None:
            return flags
        for index in range(count):
            local = self.local_rows(flat, index)
            if local.numel() and not bool(torch.isfinite(local).all()):
                flags[index] = 1.0
        return flags
