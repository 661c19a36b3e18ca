"""All-to-all of flat buffers in uneven counts, per group rank in group-rank order: how a
whole-matrix optimizer (``mfsdp_hooks.optim.whole_matrix``) brings each matrix's rows to the
rank that works on it and back. A rank's count to itself may be zero (its piece stays)."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from ..core._checks import check_flat, check_same_device
from ..core._compat import Work
from ..core.naming import group_name
from ..issuing._op_args import membership
from ..issuing.handle import CommHandle
from ..issuing.stages import issue_stages
from ..tracing.tracer import record_comm

__all__ = ["all_to_all_into"]


def _check_counts(
    counts: object, arg: str, size: int, buffer: torch.Tensor, buffer_arg: str
) -> list[int]:
    if not isinstance(counts, Sequence) or len(counts) != size:
        raise ValueError(
            f"{arg} must give one count per rank of the group ({size}), got {counts!r}"
        )
    values = [int(c) for c in counts]
    if any(c < 0 for c in values):
        raise ValueError(f"{arg} must be non-negative, got {values}")
    if sum(values) != buffer.numel():
        raise ValueError(
            f"{arg} adds up to {sum(values)} elements but {buffer_arg} has {buffer.numel()}; "
            f"size {buffer_arg} to the sum of the counts"
        )
    return values


def all_to_all_into(
    send: torch.Tensor,
    send_counts: Sequence[int],
    recv: torch.Tensor,
    recv_counts: Sequence[int],
    group: dist.ProcessGroup,
    *,
    async_op: bool = False,
) -> CommHandle:
    """Send ``send[sum(send_counts[:r]):][:send_counts[r]]`` to group rank ``r`` and receive
    rank ``r``'s piece for this rank into the same place of ``recv`` (by ``recv_counts``).
    Every rank's ``send_counts[r]`` must equal rank ``r``'s ``recv_counts`` entry for it (else
    the backend raises or hangs: derive the counts from one layout on every rank)."""
    send = check_flat(send, "send")
    recv = check_flat(recv, "recv")
    group, _, size = membership(group, "group")
    check_same_device(send, "send", recv, "recv")
    if send.dtype != recv.dtype:
        raise ValueError(f"send has dtype {send.dtype} but recv has {recv.dtype}; use one dtype")
    sent = _check_counts(send_counts, "send_counts", size, send, "send")
    received = _check_counts(recv_counts, "recv_counts", size, recv, "recv")
    if size == 1:  # a rank with nothing to exchange still takes part: the others wait on it
        return CommHandle.completed()
    record_comm("all_to_all", group_name(group), send.numel(), send.dtype)

    def issue() -> Work | None:
        work: Work | None = dist.all_to_all_single(
            recv, send, received, sent, group=group, async_op=True
        )
        return work

    return issue_stages(
        [(None, issue)],
        device=send.device,
        finish=None,
        async_op=async_op,
        keep_alive=(send, recv),
        reads=(send,),
        writes=(recv,),
        label=f"all_to_all on group {group_name(group)}",
    )
