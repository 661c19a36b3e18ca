"""Elementwise ops among tensors of one layout, run on their local tensors.

An elementwise op whose tensor arguments all share one DTensor layout (one spec: mesh,
placements, shape, stride and dtype; the same row ranges) and hold no pending reduction
(``Partial``) computes each output element from the same element of every input. Each rank's
result is then the op on its local tensors, laid out as the inputs: nothing to propagate,
nothing to redistribute. DTensor reaches the same result through its dispatcher, which
costs ~20 us per op on top of the kernel (a sharding-propagation cache lookup and a new
output spec); a torch optimizer's step is a dozen such ops per parameter, so on a model of
many small parameters that overhead, not the arithmetic, is the step.

:func:`run_locally` is that shortcut, for the row-sharded DTensors' ``__torch_dispatch__``.
It answers only what it can prove (below); everything else is left to DTensor, unchanged:

- the op is tagged ``pointwise`` (or is one of the "same layout, new values" factories:
  ``zeros_like``, ``ones_like``, ``empty_like``, ``full_like``, ``fill_``, ``zero_``; or
  ``detach``, the same values without autograd's history: ``nn.Parameter``, ``.data``),
  returns one tensor, and is not random (DTensor keeps random ops consistent across shards);
- every tensor argument is either of the same row-sharded class with the same spec and row
  ranges as the first, or a 0-dim plain tensor (a scalar every shard sees alike);
- no keyword names a device, dtype, layout or output, and the result has the first
  argument's dtype, device and strides (type promotion or a copy elsewhere falls back).

Torch's optimizers then keep their state in the parameter's class (``zeros_like`` of it),
so the whole step stays on this path.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from typing import Any

import torch
from torch.distributed.tensor import DTensor

__all__ = ["NOT_LOCAL", "run_locally"]

NOT_LOCAL: Any = object()
"""What :func:`run_locally` returns when the op is not provably local: dispatch it as DTensor."""

_aten = torch.ops.aten
_SAME_LAYOUT_OPS = frozenset(
    {
        _aten.zeros_like.default,
        _aten.ones_like.default,
        _aten.empty_like.default,
        _aten.full_like.default,
        _aten.fill_.Scalar,
        _aten.zero_.default,
        _aten.detach.default,
    }
)
_KEYWORDS_THAT_MOVE = ("device", "dtype", "layout", "pin_memory", "out")  # unless None/False


class _Kind(enum.Enum):
    IN_PLACE = "in_place"  # writes its first argument and returns it
    NEW = "new"  # returns a new tensor laid out as its first argument
    NOT_ELEMENTWISE = "not_elementwise"


_KINDS: dict[torch._ops.OpOverload, _Kind] = {}


def _kind(func: torch._ops.OpOverload) -> _Kind:
    kind = _KINDS.get(func)
    if kind is None:
        kind = _KINDS[func] = _classify(func)
    return kind


def _classify(func: torch._ops.OpOverload) -> _Kind:
    tags = func.tags
    schema = func._schema
    elementwise = torch.Tag.pointwise in tags or func in _SAME_LAYOUT_OPS
    if not elementwise or torch.Tag.nondeterministic_seeded in tags or len(schema.returns) != 1:
        return _Kind.NOT_ELEMENTWISE
    if not schema.arguments or schema.overload_name.startswith("out"):
        return _Kind.NOT_ELEMENTWISE
    first = schema.arguments[0].alias_info
    return _Kind.IN_PLACE if first is not None and first.is_write else _Kind.NEW


def run_locally(
    cls: type[DTensor],
    func: torch._ops.OpOverload,
    args: Sequence[Any],
    kwargs: dict[str, Any] | None,
    rebuild: Any,
) -> Any:
    """``func(*args, **kwargs)`` on the local tensors where that is provably DTensor's result
    (see the module docstring), else :data:`NOT_LOCAL`. ``rebuild(local, like)`` lays a new
    local tensor out as ``like`` (the class's own constructor)."""
    kind = _kind(func)
    if kind is _Kind.NOT_ELEMENTWISE or not args:
        return NOT_LOCAL
    first = args[0]
    if type(first) is not cls:
        return NOT_LOCAL
    if kwargs and (_moves(kwargs) or _any_tensor(kwargs.values())):
        return NOT_LOCAL
    locals_ = _locals_of_one_layout(first, args)
    if locals_ is None:
        return NOT_LOCAL
    out = func(*locals_, **(kwargs or {}))
    if kind is _Kind.IN_PLACE:
        return first
    local = first._local_tensor
    if out.dtype != local.dtype or out.device != local.device or out.stride() != local.stride():
        return NOT_LOCAL  # out-of-place, so running it again through DTensor is harmless
    return rebuild(out, first)


def _locals_of_one_layout(first: Any, args: Sequence[Any]) -> list[Any] | None:
    """The arguments with each tensor of ``first``'s layout replaced by its local tensor, or
    None where one is not of that layout (nor a 0-dim plain tensor)."""
    spec, ranges, stride = first._spec, first.dp_row_ranges, first.tp_partition_stride
    if any(placement.is_partial() for placement in spec.placements):
        return None
    cls = type(first)
    out: list[Any] = []
    for arg in args:
        if type(arg) is cls:
            same: Any = arg
            if same._spec is not spec and same._spec != spec:
                return None
            if same.dp_row_ranges != ranges or same.tp_partition_stride != stride:
                return None
            out.append(same._local_tensor)
            continue
        if isinstance(arg, torch.Tensor) and (isinstance(arg, DTensor) or arg.dim() != 0):
            return None
        if isinstance(arg, (list, tuple)) and _any_tensor(arg):
            return None
        out.append(arg)
    return out


def _moves(kwargs: dict[str, Any]) -> bool:
    return any(kwargs.get(key) not in (None, False) for key in _KEYWORDS_THAT_MOVE)


def _any_tensor(values: Any) -> bool:
    return any(isinstance(value, torch.Tensor) for value in values)
