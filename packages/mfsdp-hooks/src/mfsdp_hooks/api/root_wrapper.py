"""``MegatronFSDP``: the root wrapper that shards every ``fsdp_unit_modules`` match at once."""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Iterator, Sequence
from typing import Any

from torch import nn

from mfsdp_hooks.api.fully_shard import FSDPModule, fsdp_units, fully_shard, resolve_topology
from mfsdp_hooks.config.grad_allocator import make_grad_allocator
from mfsdp_hooks.config.strategy import ShardingStrategy, parse_strategy
from mfsdp_hooks.runtime.unit import unit_of
from mfsdp_hooks.weights.lookup import set_owning_model
from mfsdp_hooks.weights.meta_init import (
    MetaMaterializer,
    check_initialisable,
    materialize_in_order,
    modules_in_scope,
)

UnitSpec = type[nn.Module] | str


def resolve_unit_modules(specs: Sequence[UnitSpec] | None) -> tuple[type[nn.Module], ...]:
    """Classes from ``fsdp_unit_modules`` given as classes or ``"pkg.module.Class"`` strings."""
    if specs is None:
        return ()
    if isinstance(specs, (str, type)):
        specs = [specs]
    classes: list[type[nn.Module]] = []
    for spec in specs:
        if isinstance(spec, type) and issubclass(spec, nn.Module):
            classes.append(spec)
            continue
        if not isinstance(spec, str):
            raise TypeError(
                "fsdp_unit_modules entries must be nn.Module subclasses or import-path strings, "
                f"got {spec!r}"
            )
        module_path, _, class_name = spec.rpartition(".")
        if not module_path:
            raise ValueError(
                f"fsdp_unit_modules: {spec!r} is not an import path; write it as "
                "'package.module.ClassName'"
            )
        try:
            found = getattr(importlib.import_module(module_path), class_name)
        except (ImportError, AttributeError) as error:
            raise ValueError(
                f"fsdp_unit_modules: cannot import {spec!r} ({error}); give the class itself or "
                "its full import path 'package.module.ClassName'"
            ) from None
        if not (isinstance(found, type) and issubclass(found, nn.Module)):
            raise ValueError(f"fsdp_unit_modules: {spec!r} is not an nn.Module subclass")
        classes.append(found)
    return tuple(classes)


class MegatronFSDP(nn.Module):
    """Wraps a model: every submodule matching ``fsdp_unit_modules`` and the model itself
    become FSDP units (children first). The original model stays at ``self.module``.

    Keyword arguments are those of ``mfsdp_hooks.fully_shard`` (``sharding_strategy``,
    ``mp_policy``, ``mesh``, overlap and gradient options). ``sync_model_each_microbatch``
    defaults to False here, as in the seed: reductions of ``no_sync`` micro-batches stay in
    flight into the next one; a backward outside ``no_sync`` (the last micro-batch) waits for
    all of them, so the gradients are final when it returns.
    """

    def __init__(
        self,
        module: nn.Module,
        fsdp_unit_modules: Sequence[UnitSpec] | None = None,
        *,
        sync_model_each_microbatch: bool = False,
        init_model_with_meta_device: bool = False,
        **shard_options: Any,
    ) -> None:
        super().__init__()
        if not isinstance(module, nn.Module):
            raise TypeError(f"module must be an nn.Module, got {type(module).__name__}")
        if unit_of(module) is not None or any(unit_of(m) for m in module.modules()):
            raise ValueError(
                "module: it is already fully sharded; wrap the original model only once"
            )
        classes = resolve_unit_modules(fsdp_unit_modules)
        # One gradient-buffer allocator for the whole model, so pools are shared by its units.
        shard_options["grad_buffer_allocator"] = make_grad_allocator(
            shard_options.get("grad_buffer_allocator", "plain"),
            shard_options.get("max_inflight_reductions", 1),
        )
        targets = [m for m in module.modules() if classes and isinstance(m, classes)]
        if classes and not targets:
            _refuse_unmatched(classes, module)
        units = [sub for sub in reversed(targets) if sub is not module] + [module]
        shard_options["sync_model_each_microbatch"] = sync_model_each_microbatch
        if init_model_with_meta_device:
            _init_from_meta_and_shard(module, units, shard_options)
        else:
            for target in units:
                fully_shard(target, **shard_options)
        self.module = module
        self.fsdp_unit_modules = classes
        for unit in fsdp_units(module):
            for group in unit.groups:
                set_owning_model(group, self)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)

    @property
    def root_unit_module(self) -> FSDPModule:
        """The wrapped model, now the FSDP root (its runtime setters apply to every unit)."""
        assert isinstance(self.module, FSDPModule)
        return self.module

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients without reducing them (ZeRO-0/1; ZeRO-2/3 still reduce)."""
        with self.root_unit_module.no_sync():
            yield

    def set_requires_gradient_sync(self, requires_gradient_sync: bool) -> None:
        self.root_unit_module.set_requires_gradient_sync(requires_gradient_sync)

    def start_grad_sync(self) -> None:
        self.root_unit_module.start_grad_sync()

    def finish_grad_sync(self) -> None:
        self.root_unit_module.finish_grad_sync()

    def zero_grad_buffer(self) -> None:
        self.root_unit_module.zero_grad_buffer()

    def install_optimized_model_weights(self) -> None:
        self.root_unit_module.install_optimized_model_weights()


def _refuse_unmatched(classes: tuple[type[nn.Module], ...], module: nn.Module) -> None:
    """A unit class that matches nothing would silently make the whole model one unit
    (every weight gathered at once): refuse it, as accelerate does."""
    wanted = ", ".join(c.__qualname__ for c in classes)
    seen = list(dict.fromkeys(type(m).__qualname__ for m in module.modules()))
    raise ValueError(
        f"fsdp_unit_modules=[{wanted}] matches no module of {type(module).__name__}; its "
        f"modules are of the classes {', '.join(seen[:12])}{', ...' if len(seen) > 12 else ''}. "
        "Name the class of its repeated blocks (e.g. the transformer layer)"
    )


def _init_from_meta_and_shard(
    module: nn.Module, units: list[nn.Module], shard_options: dict[str, Any]
) -> None:
    """``init_model_with_meta_device=True``: initialise the whole model in module order (as
    building it on the device would, so the same seed gives the same weights) and shard each
    unit as soon as its last module is done (``meta_init``)."""
    strategy = parse_strategy(shard_options.get("sharding_strategy", 3), "sharding_strategy")
    if strategy == ShardingStrategy.NO_SHARD:
        raise ValueError(
            "init_model_with_meta_device=True with sharding_strategy=0 (no_shard) would "
            "materialise the whole model on every rank: use sharding_strategy 1, 2 or 3"
        )
    modules = modules_in_scope(module, skip=lambda m: False)
    check_initialisable(modules, "init_model_with_meta_device")
    topology = resolve_topology(shard_options.pop("mesh", None), module)
    materializer = MetaMaterializer(topology.device)

    def wrap(unit: nn.Module) -> None:
        fully_shard(unit, mesh=topology, **shard_options)

    materialize_in_order(modules, materializer, units, wrap=wrap)
