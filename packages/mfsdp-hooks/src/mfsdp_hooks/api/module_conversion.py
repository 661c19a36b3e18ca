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
* it changes either: refused before anything moves, naming what would change and the fix.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch
from torch import nn

from mfsdp_hooks.weights.lookup import dist_param_of

__all__ = ["managed_params_hidden"]

Conversion = Callable[[torch.Tensor], torch.Tensor]


def _managed_slots(module: nn.Module) -> list[tuple[nn.Module, str, nn.Parameter]]:
    return [
        (sub, name, param)
        for sub in module.modules()
        for name, param in sub._parameters.items()
        if param is not None and dist_param_of(param) is not None
    ]


def _check_keeps_dtype_and_device(
    fn: Conversion, kinds: set[tuple[torch.dtype, torch.device]]
) -> None:
    for dtype, device in sorted(kinds, key=str):
        with torch.no_grad():
            probe = fn(torch.empty(0, dtype=dtype, device=device))
        if probe.dtype == dtype and probe.device == device:
            continue
        raise NotImplementedError(
            f"converting a fully-sharded model's parameters from {dtype} on {device} to "
            f"{probe.dtype} on {probe.device} (model.to/.half/.cuda/... after fully_shard) is "
            "not supported: the sharded parameters live in flat buffers of a fixed dtype and "
            "device. Convert the model before sharding it, or keep it as it is and choose the "
            "compute dtype with mixed_precision_policy / mp_policy"
        )


@contextlib.contextmanager
def managed_params_hidden(module: nn.Module, fn: Conversion) -> Iterator[None]:
    """For the duration of ``module._apply(fn)``: refuse ``fn`` if it would change the
    managed parameters' dtype or device, else hide them from it (see the module note)."""
    slots = _managed_slots(module)
    _check_keeps_dtype_and_device(fn, {(p.dtype, p.device) for _, _, p in slots})
    for sub, name, _ in slots:
        sub._parameters[name] = None
    try:
        yield
    finally:
        for sub, name, param in slots:
            sub._parameters[name] = param
