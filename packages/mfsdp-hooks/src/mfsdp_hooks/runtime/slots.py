"""Which parameters a unit owns, where they sit in the module tree, and which it can take.

A unit owns the parameters of its module that no already-wrapped sub-module owns, each in
one or more (module, attribute) slots (tied weights), all of which it swaps between the
sharded and the unsharded tensor. Only plain parameters and tensor-parallel ``DTensor``s can
be flattened into a buffer and handed back as views: another tensor subclass carries state
outside its storage that a flat copy drops, so such parameters are refused at wrap time, on
every rank alike (every rank holds the same model).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterator, Sequence

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from mfsdp_collectives import is_fake

__all__ = [
    "UNIT_ATTR",
    "Slot",
    "SlotMap",
    "check_parameters_supported",
    "collect_slots",
    "describe_parameters",
    "is_wrapped",
    "parameter_lines",
    "unit_named_parameters",
]

UNIT_ATTR = "_mfsdp_unit_state"
Slot = tuple[nn.Module, str]
SlotMap = dict[int, tuple[nn.Parameter, str, list[Slot]]]


def is_wrapped(module: nn.Module) -> bool:
    """Whether ``fully_shard`` already made ``module`` a unit."""
    return UNIT_ATTR in module.__dict__


def collect_slots(module: nn.Module, ignored: frozenset[int] = frozenset()) -> SlotMap:
    """Every (module, attribute) slot holding a parameter this unit owns, keyed by parameter.

    Sub-trees already wrapped as units are skipped: they own their parameters; so are the
    parameters whose ids are ``ignored`` (FSDP2's ``ignored_params``: left as they are).
    Insertion order is the module traversal order, identical on every rank.
    """
    found: SlotMap = {}
    for mod, prefix in _walk(module, "", lambda child: not is_wrapped(child)):
        for attr, param in mod._parameters.items():
            if param is None or id(param) in ignored:
                continue
            entry = found.get(id(param))
            if entry is None:
                found[id(param)] = (param, prefix + attr, [(mod, attr)])
            else:
                entry[2].append((mod, attr))
    return found


def unit_named_parameters(member: nn.Module, prefix: str) -> list[tuple[str, nn.Parameter]]:
    """``(prefix + name, parameter)`` for each slot under ``member`` (a unit's module or
    member) that its unit owns, tied ones in each slot: the sub-trees of other units are
    skipped, as ``collect_slots`` skipped them when the unit was built."""
    unit = member.__dict__.get(UNIT_ATTR)
    return [
        (path + attr, p)
        for mod, path in _walk(member, prefix, lambda c: c.__dict__.get(UNIT_ATTR, unit) is unit)
        for attr, p in mod._parameters.items()
        if p is not None
    ]


def _walk(
    module: nn.Module, prefix: str, descend: Callable[[nn.Module], bool]
) -> Iterator[tuple[nn.Module, str]]:
    """``(module, its path prefix)`` in pre-order, into the children ``descend`` accepts: a
    loop, as a recursive closure is a reference cycle keeping the original parameters alive."""
    stack = [(module, prefix)]
    while stack:
        mod, path = stack.pop()
        yield mod, path
        children = [
            (child, f"{path}{name}.")
            for name, child in mod._modules.items()
            if child is not None and descend(child)
        ]
        stack.extend(reversed(children))  # pre-order: the first child is visited next


def _is_plain(param: torch.Tensor) -> bool:
    """A tensor with no state beside its values: a fake one (a planning run under
    ``FakeTensorMode``) stands for a plain one."""
    plain = type(param) is nn.Parameter or type(param) is torch.Tensor or type(param) is DTensor
    return plain or is_fake(param)


def check_parameters_supported(
    slots: SlotMap, module: nn.Module, claimed: Callable[[nn.Parameter], bool]
) -> None:
    """Raise naming each parameter the engine cannot shard (tensor subclasses no codec
    ``claimed``), if any."""
    unsupported = [
        (name, type(p)) for p, name, _ in slots.values() if not (_is_plain(p) or claimed(p))
    ]
    if not unsupported:
        return
    listed = ", ".join(
        f"{name!r} ({cls.__module__}.{cls.__qualname__})" for name, cls in unsupported
    )
    raise NotImplementedError(
        f"fully_shard({type(module).__name__}): parameter(s) {listed} are tensor subclasses "
        "that no codec claims (beyond DTensors of tensor parallelism): a flat sharded copy "
        "would drop their extra state and train them wrong. torchao float8 weights "
        "(enable_fsdp_float8_all_gather=True) need param_codecs=mfsdp_te.float8_codecs() "
        "(megatron_fsdp passes it); other subclasses are not supported yet: use plain "
        "nn.Parameter weights"
    )


def parameter_lines(slots: SlotMap) -> list[str]:
    """One line per parameter a unit owns, in module order: name, shape, dtype, whether it
    trains and in how many slots it sits (tied weights). Equal on every rank that wraps the
    same module; the first line that differs names what a rank built differently."""
    lines = []
    for param, name, places in slots.values():
        line = f"{name} {tuple(param.shape)} {str(param.dtype).removeprefix('torch.')}"
        line += "" if param.requires_grad else " frozen"
        line += f" tied x{len(places)}" if len(places) > 1 else ""
        lines.append(line)
    return lines


def describe_parameters(slots: SlotMap) -> str:
    """A short, rank-independent summary of the parameters a unit owns (to compare ranks;
    ``parameter_lines`` itemises it)."""
    lines = parameter_lines(slots)
    digest = hashlib.sha256("\n".join(lines).encode()).hexdigest()[:12]
    numel = sum(p.numel() for p, _, _ in slots.values())
    return f"{len(lines)} parameters, {numel} elements, digest {digest}"


def install_params(params: Sequence[nn.Parameter], param_slots: Sequence[list[Slot]]) -> None:
    """Register each parameter in every slot it occupies (tied parameters occupy several)."""
    for param, slots in zip(params, param_slots, strict=True):
        for mod, attr in slots:
            mod._parameters[attr] = param
