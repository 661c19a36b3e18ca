"""Function-level labels in profiler traces, put on both engines the same way.

``torch.profiler``'s ``with_stack=True`` Python tracer inflates the step several-fold on this
kind of hook-heavy code, so its attribution cannot be trusted. Instead, while profiling, every
function and method defined in each engine's core modules is wrapped in
``record_function("<engine>::<Class.method>")``: a few microseconds per call, and the trace
shows inclusive and self time per engine function next to the aten ops they issue.

Install before the model is wrapped: both engines capture bound methods as hooks at wrap time.
"""

from __future__ import annotations

import functools
import importlib
import inspect
from collections.abc import Callable
from types import ModuleType
from typing import Any

from torch.autograd.profiler import record_function

__all__ = ["install_labels"]

TARGETS: dict[str, tuple[str, ...]] = {
    "ours": (
        "mfsdp_hooks.weights.param_group",
        "mfsdp_hooks.runtime.unit",
        "mfsdp_hooks.runtime.root",
        "mfsdp_hooks.optim.optimizer",
        "mfsdp_collectives.ops.flat_ops",
        "mfsdp_collectives.issuing.handle",
        "mfsdp_collectives.issuing.stages",
        "mfsdp_collectives.issuing._reduce",
        "mfsdp_buffers.buffer",
        "mfsdp_buffers.allocators.storage_resize",
        "mfsdp_buffers.allocators.plain",
    ),
    "fsdp2": (
        "torch.distributed.fsdp._fully_shard._fsdp_param_group",
        "torch.distributed.fsdp._fully_shard._fsdp_param",
        "torch.distributed.fsdp._fully_shard._fsdp_state",
        "torch.distributed.fsdp._fully_shard._fsdp_collectives",
    ),
}
PREFIX = {"ours": "mfsdp", "fsdp2": "fsdp2"}
_INSTALLED: set[str] = set()


def _labelled(fn: Callable[..., Any], label: str) -> Callable[..., Any]:
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        with record_function(label):
            return fn(*args, **kwargs)

    wrapper.__wrapped_label__ = label  # type: ignore[attr-defined]
    return wrapper


def _wrap_class(cls: type, prefix: str, swapped: dict[int, Callable[..., Any]]) -> None:
    for name, attr in list(vars(cls).items()):
        if name.startswith("__") and name != "__call__":
            continue
        label = f"{prefix}::{cls.__name__}.{name}"
        if isinstance(attr, staticmethod):
            setattr(cls, name, staticmethod(_labelled(attr.__func__, label)))
        elif isinstance(attr, classmethod):
            setattr(cls, name, classmethod(_labelled(attr.__func__, label)))
        elif inspect.isfunction(attr):
            setattr(cls, name, _labelled(attr, label))


def _wrap_module(module: ModuleType, prefix: str, swapped: dict[int, Callable[..., Any]]) -> None:
    for name, obj in list(vars(module).items()):
        if getattr(obj, "__module__", None) != module.__name__:
            continue
        if inspect.isclass(obj):
            _wrap_class(obj, prefix, swapped)
        elif inspect.isfunction(obj) and not hasattr(obj, "__wrapped_label__"):
            wrapper = _labelled(obj, f"{prefix}::{name}")
            swapped[id(obj)] = wrapper
            setattr(module, name, wrapper)


def install_labels(impl: str) -> list[str]:
    """Label ``impl``'s engine functions (once per process); returns the modules touched."""
    names = TARGETS.get(impl, ())
    if impl in _INSTALLED or not names:
        return list(names)
    modules = [importlib.import_module(n) for n in names]
    swapped: dict[int, Callable[..., Any]] = {}
    for module in modules:
        _wrap_module(module, PREFIX[impl], swapped)
    # Functions imported by name into sibling modules (``from .ops import all_gather_into``)
    # keep pointing at the original: re-point them at the labelled wrapper too.
    for module in [*modules, *(importlib.import_module(n.split(".")[0]) for n in names)]:
        for name, obj in list(vars(module).items()):
            wrapper = swapped.get(id(obj))
            if wrapper is not None and inspect.isfunction(obj):
                setattr(module, name, wrapper)
    _INSTALLED.add(impl)
    return list(names)
