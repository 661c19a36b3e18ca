"""DataParallelBuffer: one flat storage per (parameter group, role) over a :class:`FlatLayout`.

Everything it hands out is a zero-copy view, so optimizer steps on shard views, all-gathers
into the unsharded tensor and parameters pointing at unsharded views act on the same bytes.
"""

from __future__ import annotations

import enum
import itertools
from collections.abc import Hashable, Sequence

import torch

from mfsdp_buffers.allocators.protocol import Allocator, allocate_checked, has_stable_storage
from mfsdp_buffers.allocators.storage_resize import StorageResizeAllocator
from mfsdp_buffers.layout import FlatLayout
from mfsdp_buffers.poison import release_to

_buffer_ids = itertools.count()


class BufferRole(enum.Enum):
    """What the buffer holds; decides nothing here, but names it for the layers above."""

    MODEL_WEIGHT = "model_weight"
    """Compute-dtype weights that are all-gathered for forward/backward."""
    MAIN_WEIGHT = "main_weight"
    """High-precision (fp32) master weights the optimizer updates."""
    MAIN_GRAD = "main_grad"
    """Gradients accumulated and reduce-scattered into the shard."""


class DataParallelBuffer:
    """Persistent local shard plus an on-demand unsharded buffer, both over one layout.

    * ``sharded=True``: only this rank's shard (``shard_numel`` elements,
      zero-initialised) is persistent; the unsharded buffer comes from
      ``allocator`` on :meth:`materialize` and goes back on :meth:`release`.
    * ``sharded=False``: the whole padded buffer is persistent (no-shard model
      weights, ZeRO-1 gradients); ``shard`` is a view of this rank's range of it
      and materialize/release cost nothing.
    * ``persistent_shard=False`` (sharded only): nothing persists; ``shard`` is this
      rank's slot of the unsharded buffer while materialized. For content rebuilt
      before each gather, such as compute weights cast from fp32 main weights.

    ``allocator`` defaults to a private :class:`StorageResizeAllocator`, so the
    unsharded tensor keeps its identity across cycles and release frees the
    bytes at once. Allocator requests use :attr:`alloc_key`, unique per buffer.
    ``pin_memory``: the persistent storage is page-locked host memory (a host buffer that an
    accelerator copies from and to asynchronously: host offload).
    """

    def __init__(
        self,
        layout: FlatLayout,
        rank: int,
        *,
        dtype: torch.dtype,
        device: torch.device,
        role: BufferRole,
        sharded: bool,
        allocator: Allocator | None = None,
        name: str = "",
        persistent_shard: bool = True,
        pin_memory: bool = False,
    ) -> None:
        if not 0 <= rank < layout.world_size:
            raise ValueError(f"rank must be in [0, {layout.world_size}), got {rank}")
        if not isinstance(role, BufferRole):
            raise TypeError(f"role must be a BufferRole, got {role!r}")
        self.layout = layout
        self.rank = rank
        self.dtype = dtype
        self.role = role
        self.sharded = sharded
        self.name = name
        self.allocator: Allocator = allocator if allocator is not None else StorageResizeAllocator()
        self.alloc_key: Hashable = (name, role.value, next(_buffer_ids))
        """Key for allocator requests: stable for the buffer's life, unique per process."""
        start, end = layout.shard_range(rank)
        if not persistent_shard and not sharded:
            raise ValueError("persistent_shard=False needs sharded=True: a whole buffer persists")
        self._full: torch.Tensor | None
        self._shard: torch.Tensor | None
        if not persistent_shard:
            self._full = None
            self._shard = None
            probe = torch.empty(0, dtype=dtype, device=device)
        elif sharded:
            self._full = None
            self._shard = probe = torch.zeros(
                layout.shard_numel, dtype=dtype, device=device, pin_memory=pin_memory
            )
        else:
            self._full = probe = torch.zeros(
                layout.padded_numel, dtype=dtype, device=device, pin_memory=pin_memory
            )
            self._shard = self._full[start:end]
        # The tensor's device, not the argument: an index-less device gains its
        # index here, so allocator size classes and comparisons see one spelling.
        self.device = probe.device
        self._unsharded: torch.Tensor | None = self._full

    def __repr__(self) -> str:
        return (
            f"DataParallelBuffer(name={self.name!r}, role={self.role.name}, rank={self.rank}, "
            f"dtype={self.dtype}, device={self.device}, sharded={self.sharded}, "
            f"shard_numel={self.layout.shard_numel}, padded_numel={self.layout.padded_numel})"
        )

    # ----------------------------------------------------------------- shard

    @property
    def has_persistent_shard(self) -> bool:
        return self._shard is not None

    @property
    def shard(self) -> torch.Tensor:
        """This rank's shard (``shard_numel``).

        Without a persistent shard (a buffer whose content is recomputed before every
        gather, e.g. compute weights cast from main weights) it is this rank's slot of the
        materialized unsharded buffer.
        """
        if self._shard is not None:
            return self._shard
        return self.unsharded_shard_view()

    def local_view(self, param_index: int) -> torch.Tensor:
        """This rank's rows of the parameter, viewed in ``shard``: ``(rows, *shape[1:])``
        (for a parameter cut along dim ``d``, its shape with ``rows`` at ``d``).

        An empty piece gives a ``(0, *shape[1:])`` tensor, so callers need no
        special case for ranks that hold nothing of a parameter.
        """
        piece = self.layout.local_piece(param_index, self.rank)
        flat = self.shard[piece.shard_offset : piece.shard_offset + piece.numel]
        return self.layout.placements[param_index].rows_view(flat, piece.num_rows)

    # ------------------------------------------------------------- unsharded

    def materialize(self) -> torch.Tensor:
        """The 1-D unsharded buffer (``padded_numel``); allocated, not filled, when sharded.

        Idempotent while materialized. With a stable-storage allocator the same
        tensor comes back on every cycle, so views taken once stay valid.
        """
        if self._unsharded is not None:
            return self._unsharded
        numel = self.layout.padded_numel
        tensor = allocate_checked(self.allocator, self.alloc_key, numel, self.dtype, self.device)
        self._unsharded = tensor
        return tensor

    @property
    def unsharded(self) -> torch.Tensor | None:
        """The materialized unsharded buffer, or None while released."""
        return self._unsharded

    @property
    def is_materialized(self) -> bool:
        return self._unsharded is not None

    @property
    def stable_storage(self) -> bool:
        """Whether :meth:`materialize` returns the same tensor and storage every cycle."""
        return not self.sharded or has_stable_storage(self.allocator)

    def unsharded_view(self, param_index: int) -> torch.Tensor:
        """The whole parameter (original shape) as a view of the unsharded buffer."""
        p = self.layout.placements[param_index]
        return p.rows_view(self._require_unsharded()[p.offset : p.end])

    def unsharded_shard_view(self) -> torch.Tensor:
        """This rank's range of the unsharded buffer (all-gather input aliasing, copy-in)."""
        start, end = self.layout.shard_range(self.rank)
        return self._require_unsharded()[start:end]

    def release(self) -> None:
        """Give the unsharded storage back to the allocator now (no-op when not sharded)."""
        if not self.sharded or self._unsharded is None:
            return
        tensor, self._unsharded = self._unsharded, None
        release_to(self.allocator, self.alloc_key, tensor)

    # ------------------------------------------------------------------ init

    def copy_params_in(self, tensors: Sequence[torch.Tensor]) -> None:
        """Fill the persistent storage from full parameters (original shapes, any dtype).

        Sharded buffers copy only the local rows. Runs without autograd so a
        source that requires grad does not drag the buffer into the graph.
        """
        if self._shard is None:
            raise RuntimeError(f"{self!r} has no persistent shard to copy parameters into")
        placements = self.layout.placements
        if len(tensors) != len(placements):
            raise ValueError(f"expected {len(placements)} tensors, got {len(tensors)}")
        for p, src in zip(placements, tensors, strict=True):
            if tuple(src.shape) != tuple(p.shape):
                raise ValueError(
                    f"tensors[{p.index}] has shape {tuple(src.shape)}; the layout expects "
                    f"{tuple(p.shape)}"
                )
        with torch.no_grad():
            for p, src in zip(placements, tensors, strict=True):
                if self._full is not None:
                    p.rows_view(self._full[p.offset : p.end]).copy_(src)
                else:
                    piece = self.layout.local_piece(p.index, self.rank)
                    if not piece.is_empty:
                        rows = p.rows_of(src, piece.row_start, piece.row_end)
                        self.local_view(p.index).copy_(rows)

    def _require_unsharded(self) -> torch.Tensor:
        if self._unsharded is None:
            raise RuntimeError(
                f"{self!r} is not materialized; call materialize() (and all-gather) first"
            )
        return self._unsharded
