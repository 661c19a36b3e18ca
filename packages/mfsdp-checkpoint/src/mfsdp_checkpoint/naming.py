"""Which writer made a DCP checkpoint, told from its metadata alone (the writers and their
namings: the package README's table), and our state renamed for another writer's loader.

DCP records, for every flattened key, the nested path it came from (``planner_data``):
``("optimizer", "state", "module.fc.weight", "exp_avg")`` or ``("optimizer", "state", 0,
"momentum_buffer")``. That path, not string splitting on dots, is what this module reads.
Nothing here communicates or reads tensor data; every rank computes the same answer.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from torch.distributed.checkpoint.metadata import Metadata

from mfsdp_checkpoint.megatron_optim import GROUP_META, to_megatron_optimizer_state
from mfsdp_checkpoint.wrapper_prefix import WRAPPER_PREFIX, prefix_of, rename_model

ObjPath = tuple[str | int, ...]

OptimizerKeys = Literal["by-name", "by-position", "megatron-distributed", "absent"]
FSDP_DTENSOR = "Megatron-LM / Megatron-Bridge fsdp_dtensor"


@dataclass(frozen=True)
class CheckpointNaming:
    """How the names of one checkpoint are written, and the writer that names them so."""

    writer: str
    """Human-readable: which library (and API) writes checkpoints named like this one."""
    model_prefix: str
    """``"module."`` when every model name carries the wrapper prefix, else ``""``."""
    optimizer_keys: OptimizerKeys
    """How optimizer state is keyed: by parameter name, by position, or no optimizer state."""
    model_names: tuple[str, ...]
    """The names of the ``"model"`` section, in the order the writer's state dict had them."""

    def describe(self) -> str:
        prefix = "model names without a wrapper prefix"
        if self.model_prefix:
            prefix = f"model names prefixed {self.model_prefix!r}"
        return f"{self.writer}: {prefix}, optimizer state {self.optimizer_keys}"


def paths_of(metadata: Metadata) -> dict[str, ObjPath]:
    """The nested path of every flattened key (DCP's ``planner_data``; the key itself when a
    writer flattened its state dict by hand)."""
    recorded = metadata.planner_data if isinstance(metadata.planner_data, Mapping) else {}
    paths: dict[str, ObjPath] = {}
    for key in metadata.state_dict_metadata:
        path = recorded.get(key)
        paths[key] = tuple(path) if path else tuple(key.split(".", 1))
    return paths


def _optimizer_keys(paths: Mapping[str, ObjPath], state_keys: list[str | int]) -> OptimizerKeys:
    if any(len(p) > 2 and p[:2] == ("optimizer", GROUP_META) for p in paths.values()):
        return "megatron-distributed"
    if not state_keys:
        return "absent"
    # DCP records dict keys as strings: torch's positions 0, 1, ... come back as "0", "1".
    return "by-position" if all(is_position(k) for k in state_keys) else "by-name"


def is_position(key: str | int) -> bool:
    """A key of torch's positional optimizer state (an int, or one DCP wrote as a string)."""
    return isinstance(key, int) or key.isdigit()


def _writer(prefix: str, optimizer: OptimizerKeys, sections: set[str], has_marker: bool) -> str:
    megatron_sections = {"checkpoint_version", "iteration"} <= sections
    if optimizer == "megatron-distributed" or (prefix and megatron_sections):
        return FSDP_DTENSOR
    if has_marker:  # ours, named natively or for another loader (naming=...)
        return "megatron-fsdp (mfsdp-checkpoint save)"
    if optimizer == "by-position":
        if prefix:
            return "NVIDIA megatron-fsdp (model.state_dict() + optimizer.state_dict())"
        return "torch optimizer.state_dict() (positional; e.g. FSDP2 without get_state_dict)"
    if prefix:
        return "megatron-fsdp (seed API, torch.distributed.checkpoint.save)"
    return "torch FSDP2 get_state_dict (or megatron-fsdp's per-module API)"


def detect_naming(metadata: Metadata, has_marker: bool = False) -> CheckpointNaming:
    """The naming of the checkpoint whose DCP metadata is ``metadata``.

    ``has_marker``: the directory has this layer's completion marker (written by
    ``mfsdp_checkpoint.save``), which tells our checkpoints from others named the same way.
    """
    paths = paths_of(metadata)
    model_names = tuple(str(p[1]) for p in paths.values() if len(p) == 2 and p[0] == "model")
    state_keys = [p[2] for p in paths.values() if len(p) > 3 and p[:2] == ("optimizer", "state")]
    # the state's names are what names an optimizer-only checkpoint
    prefix = prefix_of(list(model_names) or [str(k) for k in state_keys])
    optimizer = _optimizer_keys(paths, state_keys)
    writer = _writer(prefix, optimizer, {str(p[0]) for p in paths.values()}, has_marker)
    return CheckpointNaming(writer, prefix, optimizer, model_names)


SaveNaming = Literal["native", "fsdp2", "nvidia", "megatron"]
SAVE_NAMINGS: tuple[SaveNaming, ...] = ("native", "fsdp2", "nvidia", "megatron")


def named_for(state: dict[str, Any], naming: SaveNaming) -> dict[str, Any]:
    """``state`` (sections ``model``/``optimizer`` as ``enable_dcp`` makes them) renamed for
    the job that will load it (the package README's "Checkpoints from other writers, and ours
    for them"). The values are not copied.

    ``"nvidia"`` keys optimizer state by position in this optimizer's order. Megatron-LM's own
    files also carry ``checkpoint_version``/``iteration``/``args``: pass those as ``extra``-like
    sections of ``state`` (``megatron_fsdp.mcore_checkpoint`` does).
    """
    if naming == "native":
        return state
    if naming not in SAVE_NAMINGS:
        raise ValueError(f"naming must be one of {SAVE_NAMINGS}, got {naming!r}")
    model = state.get("model", {})
    optimizer = state.get("optimizer")
    group_names = [str(n) for g in (optimizer or {}).get("param_groups", []) for n in g["params"]]
    ours = prefix_of(list(model) or group_names)
    target = "" if naming == "fsdp2" else WRAPPER_PREFIX
    out = dict(state)
    if "model" in state:
        out["model"] = {rename_model(k, ours, target): v for k, v in model.items()}
    if optimizer is not None:
        if naming == "nvidia":
            key_of: dict[str, str | int] = {n: position for position, n in enumerate(group_names)}
        else:
            key_of = {n: rename_model(n, ours, target) for n in group_names}
        renamed = {
            **optimizer,
            "state": {key_of[str(n)]: entry for n, entry in optimizer["state"].items()},
            "param_groups": [
                {**g, "params": [key_of[str(n)] for n in g["params"]]}
                for g in optimizer["param_groups"]
            ],
        }
        megatron = naming == "megatron"
        out["optimizer"] = to_megatron_optimizer_state(renamed) if megatron else renamed
    return out
