"""Argument checks and routing shared by the collective ops (local, no communication): the
public ops check on every call, an engine's ``Route`` once per group (``Peers``). What varies
per call and is not an argument (a transport closed since) is routing (``carrier``, ``side_of``).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch
import torch.distributed as dist

from mfsdp_buffers import FlatPieces

from ..core._checks import check_flat, check_group, check_same_device
from ..core.naming import group_name
from ..host.shm import SharedMemoryTransport
from ._reduce import ReduceSpec, Reduction, reduce_op
from .streams import CommStreams

# A group's ranks never change: this rank's place in it is learned once, not per collective
# (keyed by the group object, as under torch's threaded process group each thread has its own).
_places: weakref.WeakKeyDictionary[dist.ProcessGroup, tuple[int, int]]
_places = weakref.WeakKeyDictionary()


def membership(group: object, arg: str) -> tuple[dist.ProcessGroup, int, int]:
    """``(group, rank in group, group size)``; this rank must belong to ``group``."""
    pg = check_group(group, arg)
    place = _places.get(pg)
    if place is None:
        rank = dist.get_rank(pg)
        if rank < 0:
            raise ValueError(
                f"this rank (global rank {dist.get_rank()}) is not a member of {arg}; "
                "only call the op on the ranks of the group"
            )
        place = _places[pg] = (rank, dist.get_world_size(pg))
    return pg, place[0], place[1]


@dataclass(frozen=True)
class Peers:
    """A group this rank belongs to, its rank in it and the group's size, and the transport
    that carries the group's CPU collectives (None: c10d): checked when built (``peers``)."""

    group: dist.ProcessGroup
    rank: int
    size: int
    transport: SharedMemoryTransport | None = None

    def carrier(self, x: torch.Tensor) -> SharedMemoryTransport | None:
        """The transport that carries a collective of ``x`` now (None: c10d). Only CPU
        tensors travel over shared memory, and a transport closed by ``disable_host_transport``
        has handed its group back to c10d."""
        transport = self.transport
        if transport is None or x.device.type != "cpu" or transport.closed:
            return None
        return transport


def peers(group: object, arg: str, transport: object = None) -> Peers:
    """``group`` (named ``arg`` in errors) as ``Peers``, with ``transport`` (from
    ``enable_host_transport``, or None) checked to serve it."""
    pg, rank, size = membership(group, arg)
    if transport is not None and not isinstance(transport, SharedMemoryTransport):
        raise TypeError(
            f"transport must be a SharedMemoryTransport or None, got {type(transport).__name__}"
        )
    if transport is not None and transport.group is not pg:
        raise ValueError(
            f"transport serves group {group_name(transport.group)}, not the collective's group "
            f"{group_name(pg)}: pass the transport enable_host_transport returned for it"
        )
    return Peers(pg, rank, size, transport)


def side_stream(stream: object, role: str, device: torch.device) -> torch.Stream | None:
    if stream is None:
        return None
    if not isinstance(stream, CommStreams):
        raise TypeError(f"stream must be a CommStreams or None, got {type(stream).__name__}")
    if stream.active and stream.device.type != device.type:
        raise ValueError(
            f"stream holds {stream.device.type} streams but the tensors are on {device}; "
            "build CommStreams(topology.device)"
        )
    return side_of(stream, role)


def side_of(stream: CommStreams | None, role: str) -> torch.Stream | None:
    """``stream``'s side stream for ``role`` (None: issue on the current stream)."""
    if stream is None or not stream.active:
        return None
    side: torch.Stream | None = getattr(stream, role)
    return side


def reduce_spec(spec: object) -> None:
    """Raise unless ``spec`` is a ``ReduceSpec`` (which checked its own fields; the ``Route``
    resolves it for the input's dtype, before issuing anything)."""
    if not isinstance(spec, ReduceSpec):
        raise TypeError(
            f"spec must be a mfsdp_collectives.ReduceSpec, got {type(spec).__name__}; pass "
            "spec=ReduceSpec(average=..., reduce_dtype=...)"
        )


def check_shard_sizes(
    full_numel: int, full_arg: str, shard: torch.Tensor, shard_arg: str, size: int
) -> None:
    if full_numel != shard.numel() * size:
        raise ValueError(
            f"{full_arg} has {full_numel} elements but {shard_arg} has {shard.numel()} and "
            f"the group has {size} ranks: need {full_arg}.numel() == {shard_arg}.numel() * "
            f"{size}; pad the flat buffer to a multiple of the group size"
        )


def routed_reduce_op(
    route: SharedMemoryTransport | None, group: dist.ProcessGroup, reduction: Reduction
) -> tuple[dist.ReduceOp.RedOpType, float]:
    """``reduce_op`` for a reduction that ``route`` may carry: the shared-memory transport
    averages the output chunk itself, so nothing is owed afterwards (unless ``sum_only``)."""
    if route is not None and not reduction.sum_only:
        return (dist.ReduceOp.AVG if reduction.average else dist.ReduceOp.SUM), 1.0
    return reduce_op(group, reduction.average, sum_only=reduction.sum_only)


def check_reduce_scatter(
    unsharded_grad: object,
    out_shard: object,
    group: object,
    group_arg: str,
    spec: object,
    transport: object = None,
    *,
    out_arg: str = "out_shard",
) -> tuple[torch.Tensor | FlatPieces, torch.Tensor, Peers]:
    """Check a reduce-scatter's arguments on this rank, raising before anything is issued:
    ``(input, output, peers)``."""
    out = check_flat(out_shard, out_arg)
    if isinstance(unsharded_grad, FlatPieces):
        inp: torch.Tensor | FlatPieces = unsharded_grad
    else:
        inp = check_flat(unsharded_grad, "unsharded_grad")
    check_same_device(inp, "unsharded_grad", out, out_arg)
    at = peers(group, group_arg, transport)
    reduce_spec(spec)
    numel = inp.numel if isinstance(inp, FlatPieces) else inp.numel()
    check_shard_sizes(numel, "unsharded_grad", out, out_arg, at.size)
    return inp, out, at
