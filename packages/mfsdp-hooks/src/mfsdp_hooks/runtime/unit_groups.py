"""A unit's parameter groups: which of its parameters share flat buffers and collectives
(``build_groups``; float8 weights a codec claims travel in a buffer of their own).
"""

from __future__ import annotations

from mfsdp_buffers import BucketKey, build_buckets
from mfsdp_hooks.config.unit_options import UnitOptions, claiming_codec
from mfsdp_hooks.runtime.slots import Slot, SlotMap
from mfsdp_hooks.weights.lookup import register_replaced
from mfsdp_hooks.weights.param_group import ParameterGroup

__all__ = ["build_groups"]

DENSE, EXPERT = "dp_shard", "expert_dp"


def build_groups(
    unit_name: str, slots: SlotMap, options: UnitOptions
) -> tuple[list[ParameterGroup], list[list[list[Slot]]]]:
    """The unit's groups and, per group and parameter, the slots it occupies; tags each
    original parameter with its replacement and owner (``lookup.register_replaced``)."""
    experts = options.experts
    entries = list(slots.values())
    keys, codecs = [], {}
    for index, (param, name, _) in enumerate(entries):
        kind = EXPERT if experts is not None and experts.is_expert(name, param) else DENSE
        codec = claiming_codec(options, param)
        if codec is not None:
            kind = f"{kind}+{codec.name}"
            codecs[kind] = codec
        keys.append(
            (index, BucketKey(unit_name, param.dtype, kind, param.requires_grad), param.numel())
        )
    groups, group_slots = [], []
    shard_dims = dict(options.shard_dims)
    for bucket in build_buckets(keys, max_bucket_numel=options.max_bucket_numel):
        members = [entries[i] for i in bucket.param_indices]
        topology, reduce_config = options.topology, options.reduce_config
        if bucket.key.group.startswith(EXPERT):
            assert experts is not None
            topology, reduce_config = experts.topology, experts.reduce_config(reduce_config)
        group = ParameterGroup(
            [p for p, _, _ in members],
            [n for _, n, _ in members],
            topology=topology,
            strategy=options.strategy,
            policy=options.policy,
            reduce_config=reduce_config,
            grad_allocator=options.grad_allocator,
            codec=options.codec,
            class_codec=codecs.get(bucket.key.group),
            shard_dims=[shard_dims.get(n, 0) for _, n, _ in members],
            offload=options.offload,
        )
        groups.append(group)
        group_slots.append([s for _, _, s in members])
        for (param, name, _), dist_param in zip(members, group.dist_params, strict=True):
            register_replaced(param, dist_param, f"{unit_name}({name})")
    return groups, group_slots
