"""``optimizer.state_dict()`` with DCP-ready sharded state, and its by-name form.

``optimizer.state_dict()`` keeps torch's positional format (torch's ``get_optimizer_state_dict``
relies on it to key the state by name); its sharded state tensors carry their parameter's DCP
row metadata, and an optimizer that never stepped offers placeholders for ``dcp.load`` to fill.
``named_state_dict()`` is the same state keyed by parameter name, what ``save_checkpoint``
writes (why names: the package README, "What the state dicts hold"). ``load_state_dict``
accepts both formats.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.utils.hooks import RemovableHandle

from mfsdp_checkpoint.chunks import annotate
from mfsdp_checkpoint.model_hooks import torch_sharded
from mfsdp_checkpoint.optim_placeholders import PlaceholderLedger, make_placeholders
from mfsdp_checkpoint.param_index import ParamIndex, ParamRef
from mfsdp_hooks import RowShardedDTensor, dist_param_of, dtensor_like, local_tensor, own_rows

_HOOKS_ATTR = "_mfsdp_checkpoint_hooks"


def _names_by_param(model: nn.Module) -> dict[int, str]:
    """Canonical name of every parameter object of ``model`` (dist params and plain ones)."""
    names: dict[int, str] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        dist_param = dist_param_of(param)
        names.setdefault(id(param if dist_param is None else dist_param), name)
    return names


def _laid_out_as(value: torch.Tensor, ref: ParamRef) -> torch.Tensor:
    """State shaped like its parameter, laid out as it: the optimizer's ``zeros_like`` gave a
    plain DTensor, whose ``full_tensor()`` would assume ``torch.chunk`` rows; this one knows
    the layout's."""
    param = ref.param
    if (
        isinstance(param, RowShardedDTensor)
        and isinstance(value, DTensor)
        and not isinstance(value, RowShardedDTensor)
        and value.shape == param.shape
        and value.placements == param.placements
    ):
        return dtensor_like(local_tensor(value), param)
    return value


def _full_or_torch_sharded(value: Any) -> bool:
    """A full tensor (torch's set_optimizer_state_dict passes the full one where this rank's
    state had no such key), or a DTensor in torch's layout: neither is this rank's rows."""
    if isinstance(value, DTensor):
        return torch_sharded(value)
    return isinstance(value, torch.Tensor) and value.dim() > 0


def _position(key: Any) -> Any:
    return int(key) if isinstance(key, str) and key.isdigit() else key


class OptimizerCheckpointHooks:
    """The state-dict hooks of one optimizer over the parameters of one model."""

    def __init__(self, optimizer: torch.optim.Optimizer, model: nn.Module) -> None:
        self.optimizer = optimizer
        self.index = ParamIndex(model)
        self.names = _names_by_param(model)
        unknown = [
            position for position, param in enumerate(self.params()) if id(param) not in self.names
        ]
        if unknown:
            raise ValueError(
                f"optimizer: parameters at positions {unknown} are not parameters of the model "
                "given to enable_dcp; build the optimizer from that model's parameters"
            )
        self.ledger = PlaceholderLedger()
        self.handles: list[RemovableHandle] = [
            optimizer.register_state_dict_post_hook(self.after_state_dict),
            optimizer.register_load_state_dict_pre_hook(self.before_load),
        ]

    def params(self) -> list[nn.Parameter]:
        return [p for group in self.optimizer.param_groups for p in group["params"]]

    def _name(self, param: nn.Parameter) -> str:
        name = self.names.get(id(param))
        if name is None:
            raise ValueError(
                "optimizer: a parameter added after enable_dcp is not a parameter of the model; "
                "call enable_dcp again after changing the optimizer's parameters"
            )
        return name

    def _annotated(self, entry: dict[str, Any], ref: ParamRef | None, name: str) -> dict[str, Any]:
        if ref is None:
            return dict(entry)
        return {
            key: annotate(
                _laid_out_as(value, ref), ref.chunk, ref.group, f"optimizer state {name}.{key}"
            )
            if isinstance(value, torch.Tensor)
            else value
            for key, value in entry.items()
        }

    def after_state_dict(
        self, optimizer: torch.optim.Optimizer, state_dict: dict[str, Any]
    ) -> dict[str, Any]:
        """torch's positional state dict, its tensors DCP-annotated, placeholders where a
        trainable parameter has no state yet."""
        params = self.params()
        positional = state_dict["state"]
        missing = [p for i, p in enumerate(params) if p.requires_grad and not positional.get(i)]
        placeholders = dict(
            zip((id(p) for p in missing), make_placeholders(optimizer, missing), strict=True)
        )
        self.ledger.clear()
        state: dict[int, Any] = {}
        for position, param in enumerate(params):
            name = self._name(param)
            entry = positional.get(position)
            if not entry:
                entry = placeholders.get(id(param))
                if not entry:
                    continue
                self.ledger.record(name, entry)
            state[position] = self._annotated(entry, self.index.ref_of(param), name)
        return {"state": state, "param_groups": state_dict["param_groups"]}

    def named_state_dict(self) -> dict[str, Any]:
        """``optimizer.state_dict()`` keyed by parameter name (state and groups' params)."""
        positional = self.optimizer.state_dict()
        params = self.params()
        return {
            "state": {self._name(params[i]): e for i, e in positional["state"].items()},
            "param_groups": [
                {**group, "params": [self._name(params[i]) for i in group["params"]]}
                for group in positional["param_groups"]
            ],
        }

    def before_load(
        self, optimizer: torch.optim.Optimizer, state_dict: dict[str, Any]
    ) -> dict[str, Any]:
        saved_groups = state_dict.get("param_groups", [])
        if not any(isinstance(n, str) for g in saved_groups for n in g.get("params", [])):
            # torch's positional format. torch's set_optimizer_state_dict flattens and
            # unflattens it on the way ("state.0.exp_avg"), which turns positions into
            # strings: without their int back torch would keep that state unmatched, unused.
            params = self.params()
            positional: dict[Any, Any] = {}
            for key, entry in state_dict.get("state", {}).items():
                position = _position(key)
                if (
                    isinstance(position, int)
                    and position < len(params)
                    and self.ledger.never_loaded(self._name(params[position]), entry)
                ):
                    continue  # a placeholder nothing was loaded into: the parameter stays fresh
                positional[position] = entry
            self.ledger.clear()
            return {**state_dict, "state": self._own_rows(positional)}
        params = self.params()
        position = {self._name(p): i for i, p in enumerate(params)}
        groups = optimizer.param_groups
        if len(saved_groups) != len(groups):
            raise ValueError(
                f"optimizer.load_state_dict: the state dict has {len(saved_groups)} parameter "
                f"groups, the optimizer {len(groups)}"
            )
        translated_groups = []
        for number, (saved, current) in enumerate(zip(saved_groups, groups, strict=True)):
            names = [self._name(p) for p in current["params"]]
            missing = sorted(set(names) - set(saved["params"]))
            unexpected = sorted(set(saved["params"]) - set(names))
            if missing or unexpected:
                raise ValueError(
                    f"optimizer.load_state_dict: parameter group {number} differs; missing "
                    f"parameters {missing}, unexpected parameters {unexpected}"
                )
            translated_groups.append({**saved, "params": [position[n] for n in names]})
        state: dict[int, Any] = {}
        for name, entry in state_dict.get("state", {}).items():
            if name not in position:
                raise ValueError(
                    f"optimizer.load_state_dict: state for {name!r}, which is not a parameter "
                    "of this optimizer"
                )
            if self.ledger.never_loaded(name, entry):
                continue  # a placeholder nothing was loaded into: the parameter stays fresh
            state[position[name]] = entry
        self.ledger.clear()
        return {"state": self._own_rows(state), "param_groups": translated_groups}

    def _own_rows(self, state: dict[Any, Any]) -> dict[Any, Any]:
        """Full or torch-sharded state (``set_optimizer_state_dict`` of a full state dict
        cuts it by ``torch.chunk``) as its parameter's rows; in position order, the same on
        every rank, since each torch-sharded tensor is gathered (a collective)."""
        params = self.params()
        for position in sorted(k for k in state if isinstance(k, int) and k < len(params)):
            ref = self.index.ref_of(params[position])
            if ref is None or not isinstance(ref.param, RowShardedDTensor):
                continue
            entry = state[position]
            state[position] = {
                key: own_rows(value, ref.param, f"optimizer state {ref.fqn}.{key}")
                if _full_or_torch_sharded(value)
                else value
                for key, value in entry.items()
            }
        return state

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.optimizer.__dict__.pop(_HOOKS_ATTR, None)


def install_optimizer_hooks(
    optimizer: torch.optim.Optimizer, model: nn.Module
) -> OptimizerCheckpointHooks:
    """Install the hooks on ``optimizer`` (replacing hooks bound to an older parameter list)."""
    existing = optimizer.__dict__.get(_HOOKS_ATTR)
    if isinstance(existing, OptimizerCheckpointHooks):
        existing.remove()
    hooks = OptimizerCheckpointHooks(optimizer, model)
    optimizer.__dict__[_HOOKS_ATTR] = hooks
    return hooks
