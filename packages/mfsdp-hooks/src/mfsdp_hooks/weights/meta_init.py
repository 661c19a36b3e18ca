"""Meta-device initialisation: materialise, initialise and shard one unit at a time.

Each module with parameters or buffers on meta gets real storage and runs its own
``reset_parameters()`` (or ``_reset_parameters()``), in module order; as soon as every module
of an FSDP unit is done, the unit is sharded, which frees the full tensors: no rank ever holds
more than its shards plus about one unit. Module order is construction order, so with the
same seed the result equals the model built on the device, ties included: a module whose
parameter is tied to one initialised earlier (a head tied to the embedding) initialises a
scratch copy that is dropped, as construction initialised the head's own weight before the
tie replaced it. A TP parameter (a DTensor) is initialised whole, drawing the numbers one
process draws, and each TP rank keeps its slice (``distribute_tensor`` with no source rank:
no communication), whatever RNG state TP ranks would otherwise diverge on; the cost is one
unit's full TP weights for a moment, as without TP.

The per-module ``fully_shard`` keeps FSDP2's contract instead (``initialise=False``): nothing
is initialised (FSDP2 never calls ``reset_parameters``; torchtitan's models have modules
without one); each meta *parameter* gets zeroed storage (the same on every rank, so the wrap's
replica check agrees) and buffers stay on meta for the user's ``model.to_empty(device=...)``.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable, Sequence

import torch
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

from mfsdp_hooks.weights.lookup import (
    register_materialized,
    replaced_by_unit,
    tied_to_other_unit,
)

__all__ = [
    "MetaMaterializer",
    "check_initialisable",
    "has_meta_state",
    "materialize_in_order",
    "modules_in_scope",
]

_RESET_METHODS = ("reset_parameters", "_reset_parameters")


def has_meta_state(module: nn.Module) -> bool:
    """Whether ``module`` itself (not its children) holds parameters or buffers on meta."""
    tensors = [*module.parameters(recurse=False), *module.buffers(recurse=False)]
    return any(t.device.type == "meta" for t in tensors)


def _reset_method(module: nn.Module) -> Callable[[], object] | None:
    for name in _RESET_METHODS:
        method = getattr(module, name, None)
        if callable(method):
            return method  # type: ignore[no-any-return]
    return None


def modules_in_scope(
    root: nn.Module, skip: Callable[[nn.Module], bool]
) -> list[tuple[str, nn.Module]]:
    """``root``'s modules in module order, without the subtrees ``skip`` says belong elsewhere
    (FSDP units wrapped already)."""
    found: list[tuple[str, nn.Module]] = []
    stack: list[tuple[str, nn.Module]] = [("", root)]
    while stack:
        path, module = stack.pop()
        if module is not root and skip(module):
            continue
        found.append((path, module))
        children = [(f"{path}.{n}" if path else n, c) for n, c in module.named_children()]
        stack.extend(reversed(children))
    return found


def check_initialisable(modules: Iterable[tuple[str, nn.Module]], what: str) -> None:
    """Raise (locally, before any collective) naming each meta module that cannot be
    initialised because it has no ``reset_parameters``."""
    missing = [
        f"{path or '<root>'} ({type(module).__name__})"
        for path, module in modules
        if has_meta_state(module) and _reset_method(module) is None
    ]
    if missing:
        raise ValueError(
            f"{what}: these modules hold parameters or buffers on the meta device but define "
            f"no reset_parameters() to initialise them: {missing}; add a reset_parameters() "
            "that initialises every parameter and buffer of the module, or build the model on "
            "a real device"
        )


class MetaMaterializer:
    """Gives meta modules real storage on ``device`` and runs their own initialisation, or
    (``initialise=False``, FSDP2's contract) zeroed storage for their parameters only."""

    def __init__(self, device: torch.device, initialise: bool = True) -> None:
        self._device = device
        self._initialise = initialise
        # id(meta tensor) -> (the meta tensor, kept so its id stays unique; its replacement).
        # Weak: once its unit is sharded, a materialised parameter is replaced and must be
        # freed, or wrapping ends up holding the whole model at full size.
        self._made: dict[int, tuple[torch.Tensor, weakref.ref[torch.Tensor]]] = {}

    def _replacement(
        self, old: torch.Tensor, module: nn.Module, name: str
    ) -> tuple[torch.Tensor, bool]:
        """The real tensor for ``old`` (for a DTensor, its whole global value, to initialise
        then slice), and whether it was made earlier (a tie)."""
        owner = replaced_by_unit(old)
        if owner is not None:  # tied to a weight a unit sharded already: it cannot be shared
            raise tied_to_other_unit(name, type(module).__name__, owner)
        made = self._made.get(id(old))
        tied = made[1]() if made is not None else None
        if tied is not None:
            return tied, True
        new = torch.empty(old.shape, dtype=old.dtype, device=self._device)
        if not self._initialise:  # the same on every rank: what the user's init overwrites
            new.zero_()
        if isinstance(old, nn.Parameter):
            new = nn.Parameter(new, requires_grad=old.requires_grad)
            register_materialized(old, new)
        self._made[id(old)] = (old, weakref.ref(new))
        return new, False

    def _keep_local_slice(self, old: DTensor, whole: torch.Tensor) -> torch.Tensor:
        """This rank's piece of the initialised ``whole`` of ``old``, as ``old``'s DTensor."""
        piece: torch.Tensor = distribute_tensor(
            whole.detach(), old.device_mesh, old.placements, src_data_rank=None
        )
        if isinstance(old, nn.Parameter):
            piece = nn.Parameter(piece, requires_grad=old.requires_grad)
            register_materialized(old, piece)
        self._made[id(old)] = (old, weakref.ref(piece))
        return piece

    def materialize_all(self, modules: Iterable[nn.Module]) -> None:
        """``materialize`` each of ``modules``, in order (a tied tensor gets one storage)."""
        for module in modules:
            self.materialize(module)

    def materialize(self, module: nn.Module) -> None:
        """Real storage for ``module``'s own meta tensors, then its ``reset_parameters()``."""
        if not self._initialise:
            self._zero_parameters(module)
            return
        if not has_meta_state(module):
            return
        tied: dict[str, torch.Tensor] = {}
        distributed: dict[str, DTensor] = {}
        for table in (module._parameters, module._buffers):
            for name, old in table.items():
                if old is None or old.device.type != "meta":
                    continue
                new, earlier = self._replacement(old, module, name)
                if isinstance(old, DTensor) and not earlier:
                    distributed[name] = old
                if earlier:  # initialised with its first owner: this module's init is scratch
                    tied[name] = new
                    scratch = torch.empty(old.shape, dtype=old.dtype, device=self._device)
                    new = (
                        nn.Parameter(scratch, old.requires_grad)
                        if name in module._parameters
                        else scratch
                    )
                table[name] = new  # type: ignore[assignment]
        reset = _reset_method(module)
        assert reset is not None, "check_initialisable runs first"
        with torch.no_grad():
            reset()
        for name, old in distributed.items():
            table = module._parameters if name in module._parameters else module._buffers
            whole = table[name]
            assert whole is not None
            table[name] = self._keep_local_slice(old, whole)  # type: ignore[assignment]
        for name, shared in tied.items():
            table = module._parameters if name in module._parameters else module._buffers
            table[name] = shared  # type: ignore[assignment]

    def _zero_parameters(self, module: nn.Module) -> None:
        """Zeroed storage for ``module``'s own meta parameters (one per tied parameter; a TP
        parameter keeps its DTensor form, this rank's slice); its buffers stay on meta."""
        for name, old in module._parameters.items():
            if old is None or old.device.type != "meta":
                continue
            new, earlier = self._replacement(old, module, name)
            if isinstance(old, DTensor) and not earlier:
                new = self._keep_local_slice(old, new)
            module._parameters[name] = new  # type: ignore[assignment]


def materialize_in_order(
    modules: Sequence[tuple[str, nn.Module]],
    materializer: MetaMaterializer,
    units: Sequence[nn.Module],
    wrap: Callable[[nn.Module], None],
) -> None:
    """Initialise ``modules`` in order, wrapping each unit of ``units`` right after its last
    module (a child unit always completes before its parent)."""
    position = {id(m): i for i, (_, m) in enumerate(modules)}
    ends: dict[int, list[nn.Module]] = {}
    for unit in units:
        last = max(position[id(m)] for m in unit.modules() if id(m) in position)
        ends.setdefault(last, []).append(unit)
    depth = {id(m): (p.count(".") + 1 if p else 0) for p, m in modules}
    for index, (_, module) in enumerate(modules):
        materializer.materialize(module)
        for unit in sorted(ends.get(index, []), key=lambda u: -depth[id(u)]):
            wrap(unit)
