"""Elementwise ops among tensors of one layout, run on their local tensors.

An elementwise op whose tensor arguments all share one DTensor layout (one spec: mesh,
placements, shape, stride and dtype; the same row ranges) and hold no pending reduction
(``Partial``) computes each output element from the same element of every input, so each
rank's result is the op on its local tensors, laid out as the inputs. DTensor's dispatcher
gets there for ~20 us an op on top of the kernel (sharding propagation, a new output spec);
a torch optimizer's step is a dozen such ops per parameter, so on a model of many small
parameters that overhead, not the arithmetic, is the step.

:func:`run_locally` (for the row-sharded DTensors' ``__torch_dispatch__``) answers only what
it can prove; everything else is left to DTensor, unchanged:

- the op is tagged ``pointwise``, or is a "same layout, new values" factory (``zeros_like``,
  ``ones_like``, ``empty_like``, ``full_like``, ``fill_``, ``zero_``: how torch's optimizers
  make their state, so the whole step stays on this path) or ``detach``
  (``nn.Parameter``, ``.data``), or the ``_foreach_`` form of one (``foreach=True``
  optimizers, gradient clipping's scaling), and is not random (DTensor keeps random ops
  consistent across shards);
- every tensor argument is of the same row-sharded class with the same spec and row ranges
  as the first (for a ``_foreach_`` op: element by element of the lists), or a scalar every
  shard sees alike: a 0-dim plain tensor, or a 0-dim DTensor replicated everywhere
  (``clip_grad_norm_``'s factor);
- no keyword names a device, dtype, layout or output, and the result has the first
  argument's dtype, device and strides (type promotion or a copy elsewhere falls back).

What falls back (a norm, a copy between layouts) goes to DTensor with the row-sharded tensors
as plain DTensors over the same local tensors (:func:`as_plain_dtensors`).
"""

from __future__ import annotations

import enum
import functools
from collections.abc import Sequence
from typing import Any

import torch
from torch.distributed.tensor import DTensor

__all__ = ["NOT_LOCAL", "as_plain_dtensors", "run_locally"]

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
_FOREACH = "aten::_foreach_"


class _Kind(enum.Enum):
    IN_PLACE = "in_place"  # writes its first argument and returns it
    NEW = "new"  # returns a new tensor laid out as its first argument
    FOREACH_IN_PLACE = "foreach_in_place"  # writes each tensor of its first list
    FOREACH_NEW = "foreach_new"  # returns one new tensor per tensor of its first list
    NOT_ELEMENTWISE = "not_elementwise"


@functools.cache
def _kind(func: torch._ops.OpOverload) -> _Kind:
    schema = func._schema
    if not schema.arguments or schema.overload_name.startswith("out"):
        return _Kind.NOT_ELEMENTWISE
    writes_first = (alias := schema.arguments[0].alias_info) is not None and alias.is_write
    if schema.name.startswith(_FOREACH):
        single = getattr(_aten, schema.name.removeprefix(_FOREACH), None)
        overloads = [] if single is None else [getattr(single, o) for o in single.overloads()]
        if not any(_elementwise(op) for op in overloads):
            return _Kind.NOT_ELEMENTWISE
        if writes_first and not schema.returns:
            return _Kind.FOREACH_IN_PLACE
        return _Kind.FOREACH_NEW if len(schema.returns) == 1 else _Kind.NOT_ELEMENTWISE
    if not _elementwise(func) or len(schema.returns) != 1:
        return _Kind.NOT_ELEMENTWISE
    return _Kind.IN_PLACE if writes_first else _Kind.NEW


def _elementwise(func: torch._ops.OpOverload) -> bool:
    tags = func.tags
    pointwise = torch.Tag.pointwise in tags or func in _SAME_LAYOUT_OPS
    return pointwise and torch.Tag.nondeterministic_seeded not in tags


def run_locally(
    base: type[DTensor],
    func: torch._ops.OpOverload,
    args: Sequence[Any],
    kwargs: dict[str, Any] | None,
    rebuild: Any,
) -> Any:
    """``func(*args, **kwargs)`` on the local tensors where that is provably DTensor's result
    (see the module docstring), else :data:`NOT_LOCAL`. ``base``: the row-sharded class (its
    subclasses too); ``rebuild(local, like)`` lays a new local tensor out as ``like``."""
    kind = _kind(func)
    if kind is _Kind.NOT_ELEMENTWISE or not args:
        return NOT_LOCAL
    if kwargs and (_moves(kwargs) or _any_tensor(kwargs.values())):
        return NOT_LOCAL
    if kind in (_Kind.FOREACH_IN_PLACE, _Kind.FOREACH_NEW):
        return _run_foreach(base, func, kind, args, kwargs, rebuild)
    first = args[0]
    if not isinstance(first, base):
        return NOT_LOCAL
    locals_ = _locals_of_one_layout(first, args)
    if locals_ is None:
        return NOT_LOCAL
    out = func(*locals_, **(kwargs or {}))
    if kind is _Kind.IN_PLACE:
        return first
    if not _laid_out_as(out, first):
        return NOT_LOCAL  # out-of-place, so running it again through DTensor is harmless
    return rebuild(out, first)


def _run_foreach(
    base: type[DTensor],
    func: torch._ops.OpOverload,
    kind: _Kind,
    args: Sequence[Any],
    kwargs: dict[str, Any] | None,
    rebuild: Any,
) -> Any:
    """A ``_foreach_`` op: element ``i`` of every tensor list laid out as ``args[0][i]``."""
    firsts = args[0]
    if not isinstance(firsts, (list, tuple)) or not firsts:
        return NOT_LOCAL
    is_list = [isinstance(arg, (list, tuple)) and _any_tensor(arg) for arg in args]
    lists = [arg for arg, listed in zip(args, is_list, strict=True) if listed]
    columns = _local_lists(base, firsts, lists)
    if columns is None:
        return NOT_LOCAL
    local_lists = iter(columns)
    local_args = [
        next(local_lists) if listed else _scalar(arg)
        for arg, listed in zip(args, is_list, strict=True)
    ]
    if any(arg is NOT_LOCAL for arg in local_args):
        return NOT_LOCAL
    out = func(*local_args, **(kwargs or {}))
    if kind is _Kind.FOREACH_IN_PLACE:
        return out
    if not all(_laid_out_as(o, first) for o, first in zip(out, firsts, strict=True)):
        return NOT_LOCAL  # out-of-place: harmless to run again through DTensor
    return [rebuild(o, first) for o, first in zip(out, firsts, strict=True)]


def _local_lists(
    base: type[Any], firsts: Sequence[Any], lists: Sequence[Sequence[Any]]
) -> list[list[torch.Tensor]] | None:
    """Each of a ``_foreach_`` op's tensor lists as local tensors, where element ``i`` of every
    list has the layout of ``firsts[i]``; else None. An optimizer's foreach step runs this
    per op over every parameter, so it goes list by list, identity tried before equality."""
    if any(len(tensors) != len(firsts) for tensors in lists):
        return None
    for first in firsts:
        if not isinstance(first, base) or _pending_sum(first._spec):
            return None
    columns: list[list[torch.Tensor]] = []
    for tensors in lists:
        if tensors is not firsts:
            for tensor, first in zip(tensors, firsts, strict=True):
                if tensor is not first and not _same_rows_layout(tensor, first):
                    return None
        columns.append([tensor._local_tensor for tensor in tensors])
    return columns


def _same_rows_layout(tensor: Any, first: Any) -> bool:
    """Whether ``tensor`` is of ``first``'s class, spec, rows and TP partition."""
    if type(tensor) is not type(first):
        return False
    spec, rows = tensor._spec, tensor.dp_row_ranges
    return bool(
        (spec is first._spec or spec == first._spec)
        and (rows is first.dp_row_ranges or rows == first.dp_row_ranges)
        and tensor.tp_partition_stride == first.tp_partition_stride
    )


def _pending_sum(spec: Any) -> bool:
    """Whether a mesh dim holds a pending sum (``Partial``). Mesh dim 0 of a row-sharded
    tensor is its ``Shard``, so on a 1-D mesh (every parameter of plain FSDP) none does."""
    placements = spec.placements
    return len(placements) > 1 and any(placement.is_partial() for placement in placements)


def _locals_of_one_layout(first: Any, args: Sequence[Any]) -> list[Any] | None:
    """The arguments with each tensor of ``first``'s layout replaced by its local tensor and
    each scalar tensor by its value's tensor, or None where one is neither."""
    if _pending_sum(first._spec):
        return None
    cls = type(first)
    out: list[Any] = []
    for arg in args:
        if type(arg) is cls:
            if arg is not first and not _same_rows_layout(arg, first):
                return None
            out.append(arg._local_tensor)
            continue
        value = _scalar(arg)
        if value is NOT_LOCAL:
            return None
        out.append(value)
    return out


def _scalar(arg: Any) -> Any:
    """``arg`` as every shard may read it: a non-tensor as it is, a 0-dim tensor that each
    rank holds whole (plain, or a DTensor replicated on every mesh dim) as its value;
    anything else :data:`NOT_LOCAL`."""
    if isinstance(arg, DTensor):
        if arg.dim() == 0 and all(placement.is_replicate() for placement in arg.placements):
            return arg._local_tensor
        return NOT_LOCAL
    if isinstance(arg, torch.Tensor):
        return arg if arg.dim() == 0 else NOT_LOCAL
    if isinstance(arg, (list, tuple)) and _any_tensor(arg):
        return NOT_LOCAL
    return arg


def _laid_out_as(out: torch.Tensor, like: Any) -> bool:
    local: torch.Tensor = like._local_tensor
    return (
        out.dtype == local.dtype and out.device == local.device and out.stride() == local.stride()
    )


def as_plain_dtensors(cls: type[DTensor], values: Sequence[Any]) -> list[Any]:
    """``values`` with each tensor of ``cls`` (also inside a list) as a plain ``DTensor`` over
    the same local tensor and spec: what DTensor's own dispatcher then takes."""
    return [_plain(cls, value) for value in values]


def _plain(cls: type[DTensor], value: Any) -> Any:
    if isinstance(value, cls):
        requires_grad = value.requires_grad
        return DTensor(value._local_tensor, value._spec, requires_grad=requires_grad)  # type: ignore[no-untyped-call]
    if isinstance(value, (list, tuple)) and any(isinstance(v, cls) for v in value):
        return type(value)(_plain(cls, v) for v in value)
    return value


def _moves(kwargs: dict[str, Any]) -> bool:
    return any(kwargs.get(key) not in (None, False) for key in _KEYWORDS_THAT_MOVE)


def _any_tensor(values: Any) -> bool:
    return any(isinstance(value, torch.Tensor) for value in values)
