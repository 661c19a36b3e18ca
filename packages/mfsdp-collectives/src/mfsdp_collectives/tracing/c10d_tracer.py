"""The same accounting for torch's own c10d collectives (FSDP2's, DDP's, a user's), as the
``CommRecord`` that ``CommTracer`` keeps, so a benchmark sets FSDP2's bytes beside ours with one
query API. A ``TorchDispatchMode`` (torch's ``CommDebugMode`` counts the same ops, but its
module tracker fails under ``torch.distributed.pipelining``'s forward hooks): it sees ops of
this thread only (on CPU autograd runs backward on the caller's thread). ``bytes`` is what this
rank sends in, as for ``CommTracer``. Ours show up too: through c10d, or from the shared-memory
transport as the op it stands for (``mode_echo``).
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from .tracer import CommLog, CommRecord

__all__ = ["C10dTracer"]

# c10d op name (``torch.ops.c10d.<name>``) -> (our op name, index of the tensor(s) sent in).
_OPS: dict[str, tuple[str, int]] = {
    "_reduce_scatter_base_": ("reduce_scatter", 1),
    "reduce_scatter_": ("reduce_scatter", 1),
    "reduce_scatter_tensor_coalesced_": ("reduce_scatter", 1),
    "_allgather_base_": ("all_gather", 1),
    "allgather_": ("all_gather", 1),
    "allgather_into_tensor_coalesced_": ("all_gather", 1),
    "allreduce_": ("all_reduce", 0),
    "allreduce_coalesced_": ("all_reduce", 0),
    "broadcast_": ("broadcast", 0),
    "alltoall_base_": ("all_to_all", 1),
}


def _numel_and_dtype(sent: Any) -> tuple[int, torch.dtype]:
    """A tensor, or a (nested) list of them: their total elements and the first's dtype."""
    if isinstance(sent, torch.Tensor):
        return sent.numel(), sent.dtype
    tensors = [t for item in sent for t in (item if isinstance(item, list) else [item])]
    return sum(t.numel() for t in tensors), tensors[0].dtype


class C10dTracer(CommLog, TorchDispatchMode):
    """Records torch's c10d collectives on this thread while open (see the module doc)."""

    def __init__(self) -> None:
        CommLog.__init__(self)
        TorchDispatchMode.__init__(self)  # type: ignore[no-untyped-call]

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None
    ) -> Any:
        schema = func.name()  # "c10d::<op>" for torch's collectives
        if schema.startswith("c10d::"):
            known = _OPS.get(schema.removeprefix("c10d::"))
            if known is not None:
                op, index = known
                numel, dtype = _numel_and_dtype(args[index])
                self._add(CommRecord(op, "c10d", numel, dtype, numel * dtype.itemsize))
        return func(*args, **(kwargs or {}))
