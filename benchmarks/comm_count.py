"""Collective calls and bytes per step, counted the same way for both implementations.

``mfsdp_collectives.CommTracer`` only sees our own collectives. To compare honestly we count
below both engines, at the c10d dispatcher ops that every ``torch.distributed`` call
(``all_gather_into_tensor``, ``reduce_scatter_tensor``, ``all_reduce``, coalesced variants)
and every functional collective (``torch.ops._c10d_functional``) goes through. A
``TorchDispatchMode`` sees them with their tensors, so bytes come from the actual inputs.

``bytes`` is what this rank sends in: the shard for an all-gather, the whole unsharded input
for a reduce-scatter, the tensor for an all-reduce. That matches ``CommTracer``'s convention,
so the two can be cross-checked for our engine.
"""

from __future__ import annotations

import threading
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

__all__ = ["CollectiveCounter", "classify"]

# op name -> (kind, name of the argument holding what this rank sends)
_C10D: dict[str, tuple[str, str]] = {
    "_allgather_base_": ("all_gather", "input_tensor"),
    "allgather_": ("all_gather", "input_tensors"),
    "allgather_coalesced_": ("all_gather", "input_list"),
    "allgather_into_tensor_coalesced_": ("all_gather", "inputs"),
    "_reduce_scatter_base_": ("reduce_scatter", "input_tensor"),
    "reduce_scatter_": ("reduce_scatter", "input_tensors"),
    "reduce_scatter_tensor_coalesced_": ("reduce_scatter", "inputs"),
    "allreduce_": ("all_reduce", "tensors"),
    "allreduce_coalesced_": ("all_reduce", "tensors"),
    "broadcast_": ("broadcast", "tensors"),
    "reduce_": ("reduce", "tensors"),
    "alltoall_": ("all_to_all", "input_tensors"),
    "alltoall_base_": ("all_to_all", "input"),
    "gather_": ("gather", "input_tensors"),
    "scatter_": ("scatter", "input_tensors"),
    "send": ("send", "tensors"),
    "recv_": ("recv", "tensors"),
}
_FUNCTIONAL: dict[str, tuple[str, str]] = {
    "all_gather_into_tensor": ("all_gather", "input"),
    "all_gather_into_tensor_out": ("all_gather", "input"),
    "all_gather_into_tensor_coalesced": ("all_gather", "inputs"),
    "reduce_scatter_tensor": ("reduce_scatter", "input"),
    "reduce_scatter_tensor_coalesced": ("reduce_scatter", "inputs"),
    "all_reduce": ("all_reduce", "input"),
    "all_reduce_": ("all_reduce", "input"),
    "all_reduce_coalesced": ("all_reduce", "inputs"),
    "all_reduce_coalesced_": ("all_reduce", "inputs"),
    "broadcast": ("broadcast", "input"),
    "broadcast_": ("broadcast", "input"),
    "all_to_all_single": ("all_to_all", "input"),
}
_TABLES = {"c10d": _C10D, "_c10d_functional": _FUNCTIONAL}


def classify(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[str, int] | None:
    """``(kind, bytes sent)`` when ``func`` is a collective, else None."""
    table = _TABLES.get(getattr(func, "namespace", ""))
    if table is None:
        return None
    entry = table.get(func._opname)
    if entry is None:
        return None
    kind, arg_name = entry
    names = [a.name for a in func._schema.arguments]
    value = kwargs[arg_name] if arg_name in kwargs else args[names.index(arg_name)]
    leaves, _ = tree_flatten(value)
    sent = sum(t.numel() * t.element_size() for t in leaves if isinstance(t, torch.Tensor))
    return kind, sent


class CollectiveCounter(TorchDispatchMode):  # type: ignore[no-untyped-call]
    """``calls[kind]`` and ``bytes[kind]`` of every collective issued while open."""

    def __init__(self) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self._lock = threading.Lock()
        self.calls: dict[str, int] = {}
        self.bytes: dict[str, int] = {}

    def __torch_dispatch__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        found = classify(func, args, kwargs)
        if found is not None:
            kind, sent = found
            with self._lock:
                self.calls[kind] = self.calls.get(kind, 0) + 1
                self.bytes[kind] = self.bytes.get(kind, 0) + sent
        return func(*args, **kwargs)

    def summary(self) -> dict[str, dict[str, int]]:
        with self._lock:
            return {k: {"calls": self.calls[k], "bytes": self.bytes[k]} for k in sorted(self.calls)}
