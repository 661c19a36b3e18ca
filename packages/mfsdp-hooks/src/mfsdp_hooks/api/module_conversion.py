"""``model.to(...)``, ``.float()``, ``.cuda()`` on a fully-sharded model: ``nn.Module._apply``.

[Note: conversions after sharding] ``nn.Module._apply`` calls ``fn`` on every parameter and,
for a DTensor (a wrapper subclass), swaps the parameter's contents for ``fn``'s result with
``torch.utils.swap_tensors``. Whenever ``fn`` copies (``.to(torch.device("cpu", 0))`` does,
although the device is the same), our distributed parameters would stop being views of the
flat buffers: the optimizer would step the copies while forward gathers the buffers, and
training would silently stop. FSDP2 re-points its sharded parameters after ``_apply``; our
parameters are views into buffers shared by a whole group, so instead the conversion is
probed first on an empty tensor of each (dtype, device) the engine manages:

* it keeps dtype and device (``.to(args.device)`` of ``transformers.Trainer``, ``.float()`` of
  an fp32 model, ``.to("cpu")``): the managed parameters are hidden from ``_apply`` (their
  slots read None for its duration), so buffers and unmanaged parameters still convert;
* it changes the dtype only (``.double()``, ``.to(torch.bfloat16)``): the groups are rebuilt
  in the new dtype first (``dtype_conversion``: the parameters keep their identity), then
  hidden as above;
* it changes the device: refused before anything moves, naming what would change and the fix.

[Note: meta parameters, FSDP2's contract] The per-module ``fully_shard`` of a module built on
meta shards its parameters as zeros and initialises nothing (weights/meta_init); the unit then
awaits storage (``FSDPUnit.awaiting_storage``), and its root refuses to run forward. States
and transitions, all here:

* ``await_storage`` (the wrap of a unit with meta parameters): awaiting;
* a conversion that gives meta tensors storage on the unit's device (``model.to_empty(
  device=...)``, probed on an empty meta tensor): storage given, the compute weights marked
  for re-install, so what the user's init then writes into the shards (``init_weights()``) is
  what the first forward gathers;
* any other conversion while awaiting (``.to(device)``, ``.float()``: each fails on FSDP2's
  meta parameters too) is refused, naming ``to_empty``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch
from torch import nn

from mfsdp_hooks.api.dtype_conversion import convert_managed_dtypes
from mfsdp_hooks.runtime.unit import FSDPUnit, units_under
from mfsdp_hooks.weights.lookup import dist_param_of

__all__ = ["await_storage", "managed_params_hidden"]

Conversion = Callable[[torch.Tensor], torch.Tensor]


def _managed_slots(module: nn.Module) -> list[tuple[nn.Module, str, nn.Parameter]]:
    return [
        (sub, name, param)
        for sub in module.modules()
        for name, param in sub._parameters.items()
        if param is not None and dist_param_of(param) is not None
    ]


def _check_keeps_device(fn: Conversion, kinds: set[tuple[torch.dtype, torch.device]]) -> None:
    for dtype, device in sorted(kinds, key=str):
        with torch.no_grad():
            probe = fn(torch.empty(0, dtype=dtype, device=device))
        if probe.device == device:
            continue
        raise NotImplementedError(
            f"converting a fully-sharded model's parameters from {dtype} on {device} to "
            f"{probe.dtype} on {probe.device} (model.to/.cuda/.cpu/... after fully_shard) is "
            "not supported: the sharded parameters live in flat buffers on the device of "
            "their mesh. Convert the model before sharding it"
        )


def await_storage(module: nn.Module) -> None:
    """The unit of ``module`` was wrapped from meta parameters: no forward before
    ``to_empty`` (see the note on meta parameters)."""
    for unit in units_under([module]):
        unit.awaiting_storage = True


def _give_storage(units: list[FSDPUnit], fn: Conversion) -> None:
    """``fn`` is a conversion of ``units``' meta parameters (the first, or the only one,
    after the wrap): accept ``to_empty`` onto their device, refuse anything else."""
    names = sorted({u.name for u in units})
    for device in sorted({u.options.topology.device for u in units}, key=str):
        try:
            with torch.no_grad():
                probe = fn(torch.empty(0, device="meta"))
        except NotImplementedError as error:  # a copy out of meta: .to(device), .cpu(), ...
            probe, cause = None, f" ({error})"
        else:
            cause = ""
        if probe is None or probe.device != device:
            raise NotImplementedError(
                f"the FSDP units {names} were sharded from parameters on the meta device and "
                f"have no values yet: this conversion{cause} cannot give them any. Call "
                f"model.to_empty(device={str(device)!r}) and then initialise the weights "
                "(e.g. model.init_weights() under torch.no_grad()), as with FSDP2"
            )
    for unit in units:
        unit.awaiting_storage = False
        for group in unit.groups:
            group.freshness.mark_dirty()


@contextlib.contextmanager
def managed_params_hidden(module: nn.Module, fn: Conversion) -> Iterator[None]:
    """For the duration of ``module._apply(fn)``: what the module notes say, in this order:
    storage for units awaiting it, the device check, the dtype change, then hiding."""
    awaiting = [u for u in units_under(module.modules()) if u.awaiting_storage]
    if awaiting:
        _give_storage(awaiting, fn)
    slots = _managed_slots(module)
    _check_keeps_device(fn, {(p.dtype, p.device) for _, _, p in slots})
    if slots:
        convert_managed_dtypes(module, fn, [p for _, _, p in slots])
        slots = _managed_slots(module)  # resharded: the distributed parameters
    for sub, name, _ in slots:
        sub._parameters[name] = None
    try:
        yield
    finally:
        for sub, name, param in slots:
            sub._parameters[name] = param
