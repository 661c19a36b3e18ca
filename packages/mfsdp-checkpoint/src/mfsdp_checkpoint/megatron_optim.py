"""The optimizer section of Megatron's ``fsdp_dtensor`` checkpoints, both ways.

Megatron-LM (``--ckpt-format fsdp_dtensor``; Megatron-Core's
``DistributedOptimizer.sharded_param_state_fsdp_dtensor``) saves its optimizer as::

    {"state": {name: {"exp_avg": DTensor, "exp_avg_sq": DTensor, ...}, ...},
     "param_to_group_meta": {name: {"lr": ..., "betas": ..., "step"?: ...}, ...}}

with no ``param_groups``: each parameter carries the fields of its group. ``step`` is a
per-parameter tensor in ``state`` (torch's Adam) or a group field in ``param_to_group_meta``
(TE/Apex ``FusedAdam``). Its names are the model chunk's ``named_parameters()``: two or three
``module.`` levels (adapter, ``MegatronFSDP``, ``Float16Module`` under bf16/fp16) before the
model's own path, where the model section has one.
Ours is torch's layout keyed by name; ``to_megatron_optimizer_state`` writes ``step`` in both
places, so either kind of optimizer resumes from it.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from mfsdp_checkpoint.errors import StateDictMismatchError
from mfsdp_checkpoint.wrapper_prefix import bare

GROUP_META = "param_to_group_meta"
# Megatron-LM's SwiGLU keys (fsdp_dtensor_checkpoint.is_swiglu_key; GroupedMLP's weight<i>
# has no local-spec counterpart here).
_SWIGLU = re.compile(
    r"\.mlp\.(experts\.local_experts\.\d+\.|shared_experts\.)?linear_fc1\.(weight|bias)$"
)


def is_swiglu_key(name: str) -> bool:
    """Whether ``name`` is Megatron-Core's fused ``linear_fc1`` weight or bias of a gated MLP
    (``config.gated_linear_unit``: rows ``[w; v]``), which Megatron-LM saves split as
    ``<name>_w`` and ``<name>_v`` (``handle_swiglu_in_state_dict``)."""
    return _SWIGLU.search(name) is not None


def swiglu_halves(name: str) -> tuple[str, str]:
    """The names Megatron-LM saves the halves of the fused ``name`` under (its state too; its
    group fields stay under ``name``)."""
    return f"{name}_w", f"{name}_v"


def _step_of(entry: Mapping[str, Any]) -> int | None:
    step = entry.get("step")
    if isinstance(step, torch.Tensor):
        return int(step.item())
    return None if step is None else int(step)


def to_megatron_optimizer_state(optimizer_state: Mapping[str, Any]) -> dict[str, Any]:
    """Our name-keyed optimizer state dict (``named_state_dict``) as Megatron's
    ``fsdp_dtensor`` section. The state's values are not copied."""
    state = optimizer_state["state"]
    meta: dict[str, Any] = {}
    for group in optimizer_state["param_groups"]:
        fields = {k: v for k, v in group.items() if k != "params"}
        steps = {_step_of(state[n]) for n in group["params"] if n in state}
        steps.discard(None)
        if len(steps) == 1:  # one step for the group, as FusedAdam keeps it
            fields["step"] = steps.pop()
        for name in group["params"]:
            meta[str(name)] = dict(fields)
    return {"state": dict(state), GROUP_META: meta}


@dataclass
class GroupMetaLoad:
    """How our name-keyed optimizer state loads from a Megatron ``fsdp_dtensor`` section."""

    their_name: dict[str, str]
    """Our state name -> the checkpoint's (only names the checkpoint has)."""
    meta: dict[str, dict[str, Any]]
    """The checkpoint's ``param_to_group_meta``, by our name."""
    steps_from_meta: list[str] = field(default_factory=list)
    """Our names whose ``step`` the checkpoint keeps in the group fields, not in ``state``."""

    def finish(self, optimizer_state: dict[str, Any]) -> None:
        """After DCP filled the state: group fields (and steps) from ``param_to_group_meta``.

        Only the fields this optimizer's groups have are taken, and they must agree within
        each of its groups; the others are Megatron's scheduler's (``lr_mult``, ``wd_mult``,
        ``max_lr``...), which no torch optimizer reads."""
        state = optimizer_state.get("state", {})
        for number, group in enumerate(optimizer_state.get("param_groups", [])):
            metas = [self.meta[str(n)] for n in group["params"] if str(n) in self.meta]
            used = set(group) - {"params", "step"}
            values = [{k: v for k, v in meta.items() if k in used} for meta in metas]
            differing = sorted({k for v in values for k in v if v[k] != values[0].get(k)})
            if differing:
                raise StateDictMismatchError(
                    f"parameter group {number} of this optimizer holds parameters whose "
                    f"{differing} differ in the checkpoint's param_to_group_meta (the writer had "
                    "them in different groups); build the optimizer's groups as the writer did"
                )
            if values:
                group.update(values[0])
        for name in self.steps_from_meta:
            entry = state.get(name)
            if isinstance(entry, dict) and isinstance(entry.get("step"), torch.Tensor):
                entry["step"].fill_(float(self.meta[name]["step"]))


def _meta_name(name: str) -> str:
    """Megatron-LM splits a SwiGLU ``linear_fc1``'s state as ``<name>_w``/``<name>_v`` but keeps
    its group fields under ``<name>``."""
    fused = name[:-2]
    return fused if name in swiglu_halves(fused) and is_swiglu_key(fused) else name


def plan_group_meta_load(
    our_optimizer: Mapping[str, Any],
    their_state_fields: Mapping[str, set[str]],
    their_meta: Mapping[str, Mapping[str, Any]],
) -> GroupMetaLoad:
    """Match our optimizer state (and group) names to the checkpoint's by ``bare`` name.

    ``their_state_fields``: each checkpoint state name and the fields it has; ``their_meta``:
    its ``param_to_group_meta`` (read beforehand: small objects).
    """
    theirs_by_bare: dict[str, str] = {}
    for name in their_state_fields:
        previous = theirs_by_bare.setdefault(bare(name), name)
        if previous != name:
            raise StateDictMismatchError(
                f"the checkpoint's optimizer state names {previous!r} and {name!r} name the "
                "same parameter under different wrapper prefixes"
            )
    meta_by_bare = {bare(name): dict(fields) for name, fields in their_meta.items()}
    plan = GroupMetaLoad({}, {})
    our_state = our_optimizer.get("state", {})
    group_names = [str(n) for g in our_optimizer.get("param_groups", []) for n in g["params"]]
    for ours in [*map(str, our_state), *group_names]:
        meta = meta_by_bare.get(bare(_meta_name(ours)))
        if meta is not None:
            plan.meta[ours] = meta
    for ours, entry in our_state.items():
        theirs = theirs_by_bare.get(bare(str(ours)))
        if theirs is None:
            continue
        plan.their_name[str(ours)] = theirs
        has_step = "step" in their_state_fields.get(theirs, set())
        if isinstance(entry, Mapping) and "step" in entry and not has_step:
            if "step" not in plan.meta.get(str(ours), {}):
                raise StateDictMismatchError(
                    f"the checkpoint has no step for {theirs!r} (neither in its state nor in "
                    "param_to_group_meta)"
                )
            plan.steps_from_meta.append(str(ours))
    return plan
