"""The smaller group a unit's weights are resharded onto after forward: FSDP2's
``reshard_after_forward=<int>`` (ZeRO++'s hpZ), so the backward all-gather stays inside
``size`` consecutive ranks (one node) at the cost of ``P / size`` elements per rank held from
forward to backward. Created once per shard group by its members only, so wrapping stays
collective over the shard group alone. The cache is keyed by
the shard group object, not global ranks: under torch's threaded process group each thread
has its own groups over the same ranks.
"""

from __future__ import annotations

import threading
import weakref
from dataclasses import dataclass

import torch.distributed as dist

from mfsdp_collectives.core.naming import register_group_name
from mfsdp_collectives.host.host_transport import enable_host_transport
from mfsdp_collectives.host.shm import SharedMemoryTransport
from mfsdp_collectives.safety.liveness import call_watching_peers

__all__ = ["PostForwardGroup", "check_post_forward_size", "post_forward_group"]

_lock = threading.Lock()
_subgroups: weakref.WeakKeyDictionary[dist.ProcessGroup, dict[tuple[int, ...], dist.ProcessGroup]]
_subgroups = weakref.WeakKeyDictionary()


@dataclass(frozen=True)
class PostForwardGroup:
    """This rank's subgroup of ``size`` consecutive ranks of ``parent`` (a shard group)."""

    parent: dist.ProcessGroup
    group: dist.ProcessGroup
    size: int
    rank: int
    """This rank's index in ``group``: the slice of the gathered weights it keeps."""
    transport: SharedMemoryTransport | None = None
    """How its CPU all-gathers travel: shared memory, or None for c10d."""

    def serves(self, shard_group: dist.ProcessGroup) -> bool:
        """Whether this subgroup cuts ``shard_group`` (expert groups have their own)."""
        return shard_group is self.parent


def check_post_forward_size(size: object, shard_size: int, arg: str) -> int:
    """``size`` as an int that divides ``shard_size``, or a ValueError naming ``arg``."""
    if isinstance(size, bool) or not isinstance(size, int) or size < 1 or shard_size % size:
        raise ValueError(
            f"{arg}={size!r} must be a divisor of the shard group's size ({shard_size}): the "
            "number of consecutive ranks that hold a unit's weights between forward and "
            "backward (e.g. the ranks of one node)"
        )
    return size


def post_forward_group(
    shard_group: dist.ProcessGroup, size: int, host_transport: str = "auto"
) -> PostForwardGroup:
    """This rank's subgroup of ``size`` consecutive ranks of ``shard_group``, with its CPU
    transport chosen (``host_transport``). Collective over the subgroup only."""
    check_post_forward_size(size, dist.get_world_size(shard_group), "size")
    ranks = dist.get_process_group_ranks(shard_group)
    me = dist.get_rank(shard_group)
    first = me // size * size
    members = tuple(ranks[first : first + size])
    with _lock:
        group = _subgroups.get(shard_group, {}).get(members)
    if group is None:
        group = call_watching_peers(
            lambda: dist.new_group(list(members), use_local_synchronization=True),
            members,
            "creating the group that keeps weights between forward and backward",
        )
        assert group is not None, "a member of the subgroup got no group"
        register_group_name(group, "post_forward[" + ",".join(map(str, members)) + "]")
        with _lock:
            _subgroups.setdefault(shard_group, {})[members] = group
    transport = enable_host_transport(group, host_transport)
    return PostForwardGroup(shard_group, group, size, me - first, transport)
