"""The per-module, FSDP2-compatible entry point, ``fully_shard(module, ...)``, and its
wrap-time checks."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from mfsdp_buffers import Allocator
from mfsdp_collectives import (
    FSDPTopology,
    check_host_transport,
    check_ranks_agree,
    post_forward_group,
)
from mfsdp_collectives.safety.agreement import RankFacts
from mfsdp_hooks.api.argument_checks import (
    check_flag,
    check_numel_caps,
    check_overlap_options,
    refuse_unknown_arguments,
)
from mfsdp_hooks.api.fsdp2_options import (
    check_offload_policy,
    check_reshard_after_forward,
    check_shard_placements,
)
from mfsdp_hooks.api.fsdp_module import FSDPModule, UnshardHandle
from mfsdp_hooks.api.mesh_topology import resolve_topology
from mfsdp_hooks.api.module_conversion import await_storage
from mfsdp_hooks.api.replica_values import (
    WEIGHTS,
    explain_weight_mismatch,
    summarise,
    weight_digests,
)
from mfsdp_hooks.api.wrap_agreement import UNITS_INSIDE, explain_wrap_mismatch, units_inside
from mfsdp_hooks.config.codec import IDENTITY, ParamClassCodec, ParamCodec
from mfsdp_hooks.config.experts import ExpertSharding
from mfsdp_hooks.config.grad_allocator import DoubleBuffer, make_grad_allocator
from mfsdp_hooks.config.mixed_precision import MixedPrecisionPolicy, as_policy
from mfsdp_hooks.config.reduce_config import GradReduceConfig
from mfsdp_hooks.config.strategy import (
    ShardingStrategy,
    check_post_forward_strategy,
    parse_strategy,
)
from mfsdp_hooks.config.unit_options import RootOptions, UnitOptions
from mfsdp_hooks.dtensor.tensor_parallel import check_tp_parameters
from mfsdp_hooks.runtime.member_forwards import ModuleGroup, unit_members
from mfsdp_hooks.runtime.root import FSDPRoot
from mfsdp_hooks.runtime.slots import (
    SlotMap,
    check_parameters_supported,
    collect_slots,
    describe_parameters,
    parameter_lines,
)
from mfsdp_hooks.runtime.unit import FSDPUnit, unit_of, units_under
from mfsdp_hooks.weights.lookup import set_owning_model
from mfsdp_hooks.weights.meta_init import MetaMaterializer, modules_in_scope


def _check_module(members: Sequence[nn.Module], experts: object) -> None:
    for member in members:
        existing = unit_of(member)
        if existing is not None:
            raise ValueError(
                f"module: fully_shard was already applied to this {existing.name}; "
                "apply it once per module"
            )
    if experts is not None and not isinstance(experts, ExpertSharding):
        raise TypeError(
            f"experts must be an mfsdp_hooks.ExpertSharding or None, got {type(experts).__name__}"
        )


def _agree_on_wrap(
    label: str,
    target: nn.Module,
    slots: SlotMap,
    options: UnitOptions,
    host_transport: str,
    check_replicas: bool,
) -> None:
    """The wrap's first collective: every rank of the shard group wraps the same thing, and
    (``check_replicas``) holds the same values (``replica_values``). The parameters and
    their values travel as digests and, to name the first that differs, line by line."""
    facts = {
        "module": label,
        UNITS_INSIDE: units_inside(target),
        "parameters": describe_parameters(slots),
        "host_transport": host_transport,
    }
    details = {"parameters": parameter_lines(slots)}
    if check_replicas:
        experts = options.experts
        digests = weight_digests(
            [(name, param) for param, name, _ in slots.values()],
            experts.is_expert if experts is not None else lambda name, param: False,
        )
        facts[WEIGHTS], details[WEIGHTS] = summarise(digests), digests
    for field in dataclasses.fields(options):
        value = getattr(options, field.name)
        if field.name == "topology":
            continue
        # An allocator's or codec's repr holds its address; its kind is what must agree.
        by_kind = field.name in ("grad_allocator", "codec")
        facts[field.name] = type(value).__name__ if by_kind else repr(value)
        if field.name == "codecs":
            facts[field.name] = repr([codec.name for codec in value])
        if isinstance(value, ExpertSharding):  # its topology's repr holds addresses
            facts[field.name] = value.describe()
    for group in (options.topology.shard_group, options.topology.outer_group):
        if group is not None:  # HSDP: the replicas must agree too
            check_ranks_agree(group, facts, what="fully_shard", details=details, explain=_explain)


def _explain(reports: Sequence[RankFacts]) -> str | None:
    return explain_wrap_mismatch(reports) or explain_weight_mismatch(reports)


def _ignored_ids(ignored: Iterable[nn.Parameter] | None) -> frozenset[int]:
    """As FSDP2: one set may be passed to every call; parameters of other modules are moot."""
    params = list(ignored or ())
    bad = [i for i, p in enumerate(params) if not isinstance(p, torch.Tensor)]
    if bad:
        raise TypeError(
            f"ignored_params[{bad[0]}] is a {type(params[bad[0]]).__name__}, not a parameter"
        )
    return frozenset(id(p) for p in params)


def _check_parameters(
    slots: SlotMap,
    target: nn.Module,
    codecs: tuple[ParamClassCodec, ...],
    shard_placement_fn: Callable[[nn.Parameter], Any] | None,
    topology: FSDPTopology,
) -> tuple[tuple[tuple[str, int], ...], bool]:
    """Refuse parameters the engine cannot shard; the dims ``shard_placement_fn`` cuts along,
    and whether ``codecs`` claim any parameter."""

    def claimed(param: nn.Parameter) -> bool:
        return any(codec.claims(param) for codec in codecs)

    check_parameters_supported(slots, target, claimed)
    dims = check_shard_placements(shard_placement_fn, slots, claimed, topology.tp_mesh)
    return dims, any(claimed(param) for param, _, _ in slots.values())


def _check_topology_options(
    topology: FSDPTopology, strategy: ShardingStrategy, reshard: Any
) -> tuple[bool | None, int | None]:
    """The options that depend on the topology; returns ``check_reshard_after_forward``'s."""
    if topology.shards_optimizer_across_outer and strategy != ShardingStrategy.OPTIM_GRADS_PARAMS:
        raise ValueError(
            f"sharding_strategy={strategy}: a topology that shards the optimizer across "
            "dp_outer (HFSDP) needs ZeRO-3; pass sharding_strategy=3 or replicate across dp_outer"
        )
    after_forward, group_size = check_reshard_after_forward(reshard, topology.shard_size)
    if group_size is not None:
        option = f"reshard_after_forward={reshard}"
        check_post_forward_strategy(option, strategy, "sharding_strategy", "a bool")
    return after_forward, group_size


def _meta_params_to_zeros(
    scope: list[tuple[str, nn.Module]], topology: FSDPTopology, label: str
) -> bool:
    """FSDP2's contract for meta parameters: zeroed storage to shard, initialised by the user
    after ``model.to_empty`` (weights/meta_init, api/module_conversion). Whether there were
    any. Their TP parameters are checked first (refused, not materialised, if wrong)."""
    params = [
        (f"{path}.{name}" if path else name, param)
        for path, sub in scope
        for name, param in sub.named_parameters(recurse=False)
    ]
    check_tp_parameters(params, topology, f"fully_shard({label})")
    built_on_meta = any(p.device.type == "meta" for _, p in params)
    MetaMaterializer(topology.device, initialise=False).materialize_all(sub for _, sub in scope)
    return built_on_meta


def fully_shard(
    module: nn.Module | Sequence[nn.Module],
    *,
    mesh: DeviceMesh | FSDPTopology | None = None,
    reshard_after_forward: bool | int | None = None,
    mp_policy: MixedPrecisionPolicy | Any | None = None,
    sharding_strategy: int | str | ShardingStrategy = ShardingStrategy.OPTIM_GRADS_PARAMS,
    overlap_param_gather: bool = True,
    overlap_grad_reduce: bool = True,
    sync_model_each_microbatch: bool = True,
    average_in_collective: bool = True,
    gradient_scaling_factor: float | None = None,
    calculate_per_token_loss: bool = False,
    report_nan_in_param_grad: bool = False,
    max_inflight_reductions: int = 1,
    prefetch_depth: int = 1,
    prefetch_numel: int | None = None,
    coalesce_prefetch: bool = False,
    max_bucket_numel: int | None = None,
    reduce_scatter_in_no_sync: bool = False,
    backward_prefetch_grad_fraction: float = 0.5,
    grad_buffer_allocator: str | DoubleBuffer | Allocator = "plain",
    host_transport: str = "auto",
    param_codec: ParamCodec | None = None,
    param_codecs: Sequence[ParamClassCodec] = (),
    experts: ExpertSharding | None = None,
    ignored_params: Iterable[nn.Parameter] | None = None,
    offload_policy: Any = None,
    shard_placement_fn: Callable[[nn.Parameter], Any] | None = None,
    check_replicas: bool = True,
    **unsupported: Any,
) -> Any:
    """Shard ``module``'s parameters (those not owned by an already-sharded child) in place,
    as ``torch.distributed.fsdp.fully_shard`` does, and return it, its class now also an
    ``FSDPModule``. A list of modules (``fully_shard([embed, head])``) becomes one unit.

    FSDP2's arguments behave as FSDP2's; ours and the root-level ones (``RootOptions``) are
    described in the package README ("Options worth knowing"; the codecs under "Extension
    point"; the gradient scaling ones in ``GradReduceConfig``), each checked here before
    anything is communicated. Not described there: ``max_bucket_numel`` splits the unit's
    parameters of one kind into collectives of at most that many elements;
    ``check_replicas`` (not FSDP2's, which trains a patchwork silently) also compares the
    values of the weights across the ranks and raises on every rank, naming the first that
    differs; pass False when you load the weights into the sharded model after wrapping.
    """
    refuse_unknown_arguments(unsupported)
    members = unit_members(module)
    _check_module(members, experts)
    # One module is its own scope; several are gathered into a container outside the tree.
    target = members[0] if len(members) == 1 else ModuleGroup(members)
    label = "+".join(type(m).__name__ for m in members)
    policy = MixedPrecisionPolicy() if mp_policy is None else as_policy(mp_policy, "mp_policy")
    strategy = parse_strategy(sharding_strategy, "sharding_strategy")
    check_overlap_options(max_inflight_reductions, prefetch_depth, backward_prefetch_grad_fraction)
    check_numel_caps(prefetch_numel=prefetch_numel, max_bucket_numel=max_bucket_numel)
    check_flag(coalesce_prefetch, "coalesce_prefetch")
    check_flag(check_replicas, "check_replicas")
    grad_allocator = make_grad_allocator(grad_buffer_allocator, max_inflight_reductions)
    check_host_transport(host_transport)  # before resolve_topology, which may communicate
    scope = modules_in_scope(target, skip=lambda m: unit_of(m) is not None)
    topology = resolve_topology(mesh, target)
    reshard, post_forward_size = _check_topology_options(topology, strategy, reshard_after_forward)
    built_on_meta = _meta_params_to_zeros(scope, topology, label)
    slots = collect_slots(target, _ignored_ids(ignored_params))
    codecs = tuple(param_codecs)
    shard_dims, claimed = _check_parameters(slots, target, codecs, shard_placement_fn, topology)
    offload = check_offload_policy(offload_policy, topology, strategy, codecs=claimed)
    options = UnitOptions(
        topology=topology,
        strategy=strategy,
        policy=policy,
        reduce_config=GradReduceConfig(
            average_in_collective=average_in_collective,
            gradient_scaling_factor=gradient_scaling_factor,
            calculate_per_token_loss=calculate_per_token_loss,
        ),
        reshard_after_forward=reshard,
        reshard_after_forward_group_size=post_forward_size,
        overlap_param_gather=overlap_param_gather,
        root=RootOptions(
            overlap_grad_reduce=overlap_grad_reduce,
            sync_model_each_microbatch=sync_model_each_microbatch,
            report_nan_in_param_grad=report_nan_in_param_grad,
            max_inflight_reductions=max_inflight_reductions,
            prefetch_depth=prefetch_depth,
            prefetch_numel=prefetch_numel,
            coalesce_prefetch=coalesce_prefetch,
            reduce_scatter_in_no_sync=bool(reduce_scatter_in_no_sync),
        ),
        backward_prefetch_grad_fraction=float(backward_prefetch_grad_fraction),
        grad_allocator=grad_allocator,
        codec=param_codec or IDENTITY,
        codecs=codecs,
        experts=experts,
        max_bucket_numel=max_bucket_numel,
        shard_dims=shard_dims,
        offload=offload,
    )
    _agree_on_wrap(label, target, slots, options, host_transport, check_replicas)
    _make_unit(target, members, _with_transports(options, host_transport), slots)
    if built_on_meta:
        await_storage(target)
    return module


def _with_transports(options: UnitOptions, host_transport: str) -> UnitOptions:
    """The options over topologies with their CPU transports chosen (collective over the
    groups unless ``"gloo"``, so only after the ranks agreed on every option)."""
    experts, topology = options.experts, options.topology
    size = options.reshard_after_forward_group_size
    on_host = host_transport if topology.device.type == "cpu" else "gloo"
    return dataclasses.replace(
        options,
        topology=topology.with_host_transport(host_transport),
        experts=None if experts is None else experts.adopted(host_transport),
        post_forward=None
        if size is None
        else post_forward_group(topology.shard_group, size, on_host),
    )


def _make_unit(
    target: nn.Module, members: list[nn.Module], options: UnitOptions, slots: SlotMap
) -> None:
    """Build the unit, then give each member ``FSDPModule``'s methods."""
    FSDPUnit(target, options, FSDPRoot.lazy_init, slots, members=members)
    for unit in fsdp_units(target):
        for group in unit.groups:
            set_owning_model(group, members[0])
    for member in members:
        if not isinstance(member, FSDPModule):
            member.__class__ = fsdp_class_of(type(member))


_FSDP_CLASSES: dict[type[nn.Module], type[nn.Module]] = {}
# FSDP<cls>'s MRO: itself, FSDPModule's classes but ``object``, then ``cls``.
_MRO_INDEX = len(FSDPModule.__mro__)


def _refuse_deepcopy(self: nn.Module, memo: dict[int, Any]) -> nn.Module:
    raise TypeError(
        f"copy.deepcopy of a fully-sharded {type(self).__name__} is not supported: the copy "
        "would share the original's hooks and buffers. Build a fresh model and load a state "
        "dict (model.state_dict() / mfsdp_checkpoint) into it instead"
    )


def fsdp_class_of(cls: type[nn.Module]) -> type[nn.Module]:
    """``FSDP<cls>``: ``cls`` with ``FSDPModule``'s methods, built once per class (so every
    wrapped ``Block`` has the same class, as with FSDP2)."""
    found = _FSDP_CLASSES.get(cls)
    if found is None:
        # Torch's FSDPModule.__new__ builds an instance of the original class (container
        # slicing, ``type(m)(...)``) from this index in the MRO: after FSDPModule's own.
        namespace = {"__deepcopy__": _refuse_deepcopy, "_orig_cls_mro_index": _MRO_INDEX}
        found = type(f"FSDP{cls.__name__}", (FSDPModule, cls), namespace)
        assert found.__mro__[_MRO_INDEX] is cls, found.__mro__
        _FSDP_CLASSES[cls] = found
    return found


def fsdp_units(module: nn.Module) -> list[FSDPUnit]:
    """Every unit under ``module`` once, in module order."""
    return units_under(module.modules())


def is_fully_sharded(module: nn.Module) -> bool:
    return unit_of(module) is not None


__all__ = ["FSDPModule", "UnshardHandle", "fsdp_units", "fully_shard", "is_fully_sharded"]
