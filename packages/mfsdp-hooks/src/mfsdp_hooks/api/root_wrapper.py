"""``FSDPRootWrapper``: the root wrapper that shards every ``fsdp_unit_modules`` match at once."""

from __future__ import annotations

import contextlib
import functools
import importlib
from collections.abc import Iterator, Sequence
from typing import Any

from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from mfsdp_buffers import Allocator
from mfsdp_collectives import FSDPTopology
from mfsdp_hooks.api.ddp_refusal import RefusesDDP
from mfsdp_hooks.api.fully_shard import FSDPModule, fsdp_units, fully_shard
from mfsdp_hooks.api.mesh_topology import resolve_topology
from mfsdp_hooks.config.grad_allocator import make_grad_allocator
from mfsdp_hooks.config.mixed_precision import MixedPrecisionPolicy
from mfsdp_hooks.config.sharding_options import ShardingOptions
from mfsdp_hooks.config.strategy import ShardingStrategy
from mfsdp_hooks.runtime.unit import unit_of
from mfsdp_hooks.weights.lookup import set_owning_model
from mfsdp_hooks.weights.meta_init import (
    MetaMaterializer,
    check_initialisable,
    materialize_in_order,
    modules_in_scope,
)
from mfsdp_hooks.weights.param_group import broadcast_from_first_rank

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


class FSDPRootWrapper(RefusesDDP, nn.Module):
    """Wraps a model: every submodule matching ``fsdp_unit_modules`` and the model itself
    become FSDP units (children first). The original model stays at ``self.module``, and
    attributes the wrapper does not have are read from it (``wrapper.generate(...)``).

    ``options`` (a ``ShardingOptions``; None: its defaults) carries every choice, under the
    seed's names; each unit gets them as explicit arguments of the per-module ``fully_shard``.
    """

    def __init__(
        self,
        module: nn.Module,
        fsdp_unit_modules: Sequence[UnitSpec] | None = None,
        options: ShardingOptions | None = None,
    ) -> None:
        super().__init__()
        if not isinstance(module, nn.Module):
            raise TypeError(f"module must be an nn.Module, got {type(module).__name__}")
        if unit_of(module) is not None or any(unit_of(m) for m in module.modules()):
            raise ValueError(
                "module: it is already fully sharded; wrap the original model only once"
            )
        options = ShardingOptions() if options is None else options
        classes = resolve_unit_modules(fsdp_unit_modules)
        # One gradient-buffer allocator for the whole model, so pools are shared by its units.
        allocator = make_grad_allocator(
            options.grad_buffer_allocator, options.max_inflight_reductions
        )
        targets = [m for m in module.modules() if classes and isinstance(m, classes)]
        if classes and not targets:
            _refuse_unmatched(classes, module)
        units = [sub for sub in reversed(targets) if sub is not module] + [module]
        if options.fine_grained_param_gather:
            units = fine_grained_units(module, units, options.zero_dp_strategy)
        if options.init_model_with_meta_device:
            _init_from_meta_and_shard(module, units, options, allocator)
        else:
            for target in units:
                _shard_unit(target, options, options.device_mesh, allocator)
        self.module = module
        self.fsdp_unit_modules = classes
        self.sharding_options = options
        for unit in fsdp_units(module):
            for group in unit.groups:
                set_owning_model(group, self)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        """What the wrapper lacks, the wrapped model answers (``generate``, ``config``,
        ``save_pretrained``...), as torch's ``fully_shard`` leaves a model its own class.
        Dunder names and the wrapper's own state are never forwarded."""
        try:
            return super().__getattr__(name)
        except AttributeError:
            if name.startswith("__") or name == "module":
                raise
            return getattr(super().__getattr__("module"), name)

    def mixed_precision_context(self, policy: Any) -> contextlib.AbstractContextManager[None]:
        """Another mixed-precision policy for a region (``with model.mixed_precision_context(
        dataclasses.replace(model.mixed_precision_policy, param_dtype=torch.bfloat16)):``):
        ``reduce_dtype`` for the reductions of its backwards, ``param_dtype``/
        ``cast_forward_inputs``/``output_dtype`` for forwards without autograd (evaluation,
        generation). See ``mfsdp_hooks.runtime.compute_region``."""
        return self.root_unit_module.mixed_precision_context(policy)

    @property
    def mixed_precision_policy(self) -> MixedPrecisionPolicy:
        """The policy the model was wrapped with."""
        return self.root_unit_module.mixed_precision_policy

    @property
    def root_unit_module(self) -> FSDPModule:
        """The wrapped model, now the FSDP root (its runtime setters apply to every unit)."""
        assert isinstance(self.module, FSDPModule)
        return self.module

    def no_sync(self) -> contextlib.AbstractContextManager[None]:
        """Accumulate gradients without a full reduction (ZeRO-2/3 still reduce-scatter each
        micro-batch while ``reduce_scatter_in_no_sync`` is set, Megatron-FSDP's default)."""
        return self.root_unit_module.no_sync()

    def set_requires_gradient_sync(self, requires_gradient_sync: bool) -> None:
        self.root_unit_module.set_requires_gradient_sync(requires_gradient_sync)

    def set_reduce_scatter_in_no_sync(self, reduce_scatter_in_no_sync: bool) -> None:
        """The root's ``FSDPModule.set_reduce_scatter_in_no_sync``: under ``no_sync``, ZeRO-2/3
        reduce-scatter every micro-batch (True) or once, at the synced backward (False)."""
        self.root_unit_module.set_reduce_scatter_in_no_sync(reduce_scatter_in_no_sync)

    def start_grad_sync(self) -> None:
        self.root_unit_module.start_grad_sync()

    def finish_grad_sync(self) -> None:
        self.root_unit_module.finish_grad_sync()

    def zero_grad_buffer(self) -> None:
        self.root_unit_module.zero_grad_buffer()

    def scale_gradients(self, scaling_factor: float) -> None:
        """Multiply every reduced gradient by ``scaling_factor`` in place (Megatron-Core's loss
        scaling and per-token normalisation call this after the reduction)."""
        for unit in fsdp_units(self.module):
            for group in unit.groups:
                group.scale_main_grads(scaling_factor)

    def broadcast_params(self) -> None:
        """Every rank's weights from data-parallel rank 0 (Megatron-Core's
        ``--data-parallel-random-init``); the compute weights follow at the next unshard.
        Collective: call it on every rank."""
        for unit in fsdp_units(self.module):
            for group in unit.groups:
                broadcast_from_first_rank(group)

    def install_optimized_model_weights(self) -> None:
        self.root_unit_module.install_optimized_model_weights()


def _shard_unit(
    target: nn.Module,
    options: ShardingOptions,
    mesh: DeviceMesh | FSDPTopology | None,
    allocator: Allocator,
) -> None:
    """``fully_shard`` on one unit, each of the record's fields an explicit argument (under
    ``fully_shard``'s FSDP2 names: the one place a name changes on the way down)."""
    fully_shard(
        target,
        mesh=mesh,
        reshard_after_forward=options.reshard_after_forward,
        mp_policy=options.mixed_precision_policy,
        sharding_strategy=options.zero_dp_strategy,
        overlap_param_gather=options.overlap_param_gather,
        overlap_grad_reduce=options.overlap_grad_reduce,
        sync_model_each_microbatch=options.sync_model_each_microbatch,
        average_in_collective=options.average_in_collective,
        gradient_scaling_factor=options.gradient_scaling_factor,
        calculate_per_token_loss=options.calculate_per_token_loss,
        report_nan_in_param_grad=options.report_nan_in_param_grad,
        max_inflight_reductions=options.max_inflight_reductions,
        prefetch_depth=options.prefetch_depth,
        prefetch_numel=options.prefetch_numel,
        coalesce_prefetch=options.coalesce_prefetch,
        max_bucket_numel=options.max_bucket_numel,
        reduce_scatter_in_no_sync=options.reduce_scatter_in_no_sync,
        backward_prefetch_grad_fraction=options.backward_prefetch_grad_fraction,
        grad_buffer_allocator=allocator,
        host_transport=options.host_transport,
        param_codec=options.param_codec,
        param_codecs=options.param_codecs,
        experts=options.experts,
        offload_policy=options.offload_policy,
        check_replicas=options.check_replicas,
    )


def fine_grained_units(
    module: nn.Module, units: list[nn.Module], strategy: ShardingStrategy
) -> list[nn.Module]:
    """``units`` (children first) with each one's parameter-holding leaf modules before it,
    as units of their own (``ShardingOptions.fine_grained_param_gather``; ``strategy`` is
    its ``zero_dp_strategy``)."""
    if strategy != ShardingStrategy.OPTIM_GRADS_PARAMS:
        raise ValueError(
            "enable_fine_grained_param_gather=True splits the per-forward all-gathers of "
            "ZeRO-3 units; with another zero_dp_strategy nothing is gathered per forward: use "
            "zero_dp_strategy=3 or leave it False"
        )
    uses: dict[int, int] = {}
    for _, param in module.named_parameters(remove_duplicate=False):
        uses[id(param)] = uses.get(id(param), 0) + 1
    claimed = {id(u) for u in units}
    ordered: list[nn.Module] = []
    for unit in units:
        for sub in _own_modules(unit, claimed):
            params = list(sub.parameters(recurse=False))
            leaf = sub is not unit and not any(True for _ in sub.children())
            if leaf and params and all(uses[id(p)] == 1 for p in params):
                ordered.append(sub)
        ordered.append(unit)
    return ordered


def _own_modules(unit: nn.Module, claimed: set[int]) -> Iterator[nn.Module]:
    """``unit`` and its modules, without the subtrees of other units."""
    yield unit
    for child in unit.children():
        if id(child) not in claimed:
            yield from _own_modules(child, claimed)


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
    module: nn.Module, units: list[nn.Module], options: ShardingOptions, allocator: Allocator
) -> None:
    """``init_model_with_meta_device=True``: initialise the whole model in module order (as
    building it on the device would, so the same seed gives the same weights) and shard each
    unit as soon as its last module is done (``meta_init``)."""
    if options.zero_dp_strategy == ShardingStrategy.NO_SHARD:
        raise ValueError(
            "init_model_with_meta_device=True with zero_dp_strategy=0 (no_shard) would "
            "materialise the whole model on every rank: use zero_dp_strategy 1, 2 or 3"
        )
    modules = modules_in_scope(module, skip=lambda m: False)
    check_initialisable(modules, "init_model_with_meta_device")
    topology = resolve_topology(options.device_mesh, module)
    materializer = MetaMaterializer(topology.device)
    wrap = functools.partial(_shard_unit, options=options, mesh=topology, allocator=allocator)
    materialize_in_order(modules, materializer, units, wrap=wrap)
