"""Load a checkpoint named by another writer: map our state dict's keys onto its keys.

``plan_key_map`` compares the naming of the state dict being loaded (ours) with the naming
of the checkpoint (``naming.detect_naming``) and, where they differ, gives a ``KeyPlan``: a
flat state dict under the checkpoint's keys whose values are our tensors, so DCP loads (and
reshards) straight into our storage; objects it loads are copied back to our nesting after.
What is mapped, and why ``param_groups``' parameter lists are checked but never loaded: the
package README ("Checkpoints from other writers").
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint._nested_dict import flatten_state_dict
from torch.distributed.checkpoint.filesystem import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load

from mfsdp_checkpoint.errors import StateDictMismatchError
from mfsdp_checkpoint.megatron_optim import GROUP_META, plan_group_meta_load
from mfsdp_checkpoint.naming import (
    FSDP_DTENSOR,
    CheckpointNaming,
    ObjPath,
    detect_naming,
    is_position,
    paths_of,
)
from mfsdp_checkpoint.positions import PositionEvidence, Shape, derive_positions
from mfsdp_checkpoint.wrapper_prefix import prefix_of, rename_model


def key_of(path: ObjPath) -> str:
    """DCP's flattened key of a nested path."""
    return ".".join(str(part) for part in path)


@dataclass
class KeyPlan:
    """What to hand DCP, and where its values go back in our state dict."""

    naming: CheckpointNaming
    flat: dict[str, Any]
    """The state dict DCP loads: the checkpoint's keys, our values (our nested dict itself when
    nothing is renamed)."""
    sections: set[str]
    """Our top-level sections (a flat dict's keys no longer tell them)."""
    ours: dict[str, ObjPath] = field(default_factory=dict)
    """Checkpoint key -> our nested path of its value (empty when nothing is renamed)."""
    derivation: str = ""
    """How positions of positional optimizer state were matched to names (when they were);
    ``load`` logs it (logger ``mfsdp_checkpoint``, INFO, rank 0) with the writer's naming."""
    finish: Callable[[dict[str, Any]], None] | None = None
    """What ``copy_back`` does last, on our nested state dict (fields DCP has no key for)."""

    @property
    def renames(self) -> bool:
        return bool(self.ours)

    def our_paths(self, flat_paths: list[ObjPath]) -> list[ObjPath]:
        """Paths in ``flat`` as paths in our nested dict."""
        if not self.renames:
            return flat_paths
        return [self.ours[str(path[0])] for path in flat_paths if str(path[0]) in self.ours]

    def copy_back(self, state_dict: dict[str, Any]) -> None:
        """Put what DCP loaded into ``flat`` (objects replaced, tensors filled in place) into
        ``state_dict`` at our paths."""
        for key, path in self.ours.items():
            if key in self.flat:
                _set(state_dict, path, self.flat[key])
        if self.finish is not None:
            self.finish(state_dict)


def _set(root: dict[str, Any], path: ObjPath, value: Any) -> None:
    node: Any = root
    for part in path[:-1]:
        node = node[part]
    node[path[-1]] = value


def read_objects(path: Path, keys: list[str]) -> dict[str, Any]:
    """The pickled values at ``keys`` of the DCP checkpoint at ``path``, read by this process
    alone (no collective)."""
    box: dict[str, Any] = dict.fromkeys(keys)
    if keys:
        dcp_load(box, storage_reader=FileSystemReader(path), no_dist=True)
    return box


def plan_key_map(
    state_dict: dict[str, Any], metadata: Metadata, source: Path, has_marker: bool
) -> KeyPlan:
    """How ``state_dict`` loads from the checkpoint at ``source`` (whose metadata is
    ``metadata``). Reads only metadata and the small ``param_groups`` objects; identical on
    every rank."""
    naming = detect_naming(metadata, has_marker)
    flat, mapping = flatten_state_dict(state_dict)
    paths = {key: tuple(mapping[key]) for key in flat}
    model_names = [str(p[1]) for p in paths.values() if len(p) == 2 and p[0] == "model"]
    our_groups = _our_groups(state_dict.get("optimizer"))
    ours = prefix_of(model_names or [n for group in our_groups or [] for n in group])

    def theirs(name: str) -> str:
        return rename_model(name, ours, naming.model_prefix)

    if "optimizer" in state_dict and naming.optimizer_keys == "megatron-distributed":
        if our_groups is None:
            raise StateDictMismatchError(
                f"{source} is a {FSDP_DTENSOR} checkpoint, whose optimizer state is keyed by "
                "parameter name; this optimizer's state dict is positional: call "
                "mfsdp_checkpoint.enable_dcp(model, optimizer) first (load_checkpoint does)"
            )
        return _plan_group_meta(state_dict, flat, paths, metadata, source, naming, theirs)
    positional = naming.optimizer_keys == "by-position" and our_groups is not None
    if ours == naming.model_prefix and not positional:
        return KeyPlan(naming, state_dict, {str(k) for k in state_dict})
    position: dict[str, int] = {}
    derivation = ""
    if our_groups is not None and naming.optimizer_keys != "absent":
        writer_groups = _writer_groups(metadata, source)
        if positional:
            saved_model_shapes, state_shapes = _saved_shapes(metadata)

            def ours_name(name: str) -> str:
                return rename_model(name, naming.model_prefix, ours)

            evidence = PositionEvidence(
                our_groups=our_groups,
                writer_groups=writer_groups,
                model_order=[ours_name(n) for n in naming.model_names],
                state_shapes=state_shapes,
                param_shapes={
                    str(p[1]): tuple(flat[k].shape)
                    for k, p in paths.items()
                    if len(p) == 2 and p[0] == "model" and isinstance(flat[k], torch.Tensor)
                }
                # Loading the optimizer alone (weights=False): the checkpoint's model section
                # tells the shapes that tell two parameter orders apart.
                or {ours_name(n): shape for n, shape in saved_model_shapes.items()},
            )
            position, derivation = derive_positions(evidence)
        else:
            _check_named_groups(our_groups, writer_groups, theirs)
    renamed: dict[str, Any] = {}
    back: dict[str, ObjPath] = {}
    for key, value in flat.items():
        path = paths[key]
        target = _translate(path, theirs, position)
        renamed[key_of(target)] = value
        if path[:2] != ("optimizer", "param_groups") or path[-1] != "params":
            back[key_of(target)] = path  # the parameter lists stay ours (checked above)
    return KeyPlan(naming, renamed, {str(k) for k in state_dict}, back, derivation)


def _plan_group_meta(
    state_dict: dict[str, Any],
    flat: dict[str, Any],
    paths: dict[str, ObjPath],
    metadata: Metadata,
    source: Path,
    naming: CheckpointNaming,
    theirs: Callable[[str], str],
) -> KeyPlan:
    """Ours (torch's layout keyed by name) from a Megatron ``fsdp_dtensor`` checkpoint."""
    theirs_paths = paths_of(metadata)
    fields: dict[str, set[str]] = {}
    meta_keys: dict[str, ObjPath] = {}
    for key, path in theirs_paths.items():
        if len(path) >= 4 and path[:2] == ("optimizer", "state"):
            fields.setdefault(str(path[2]), set()).add(str(path[3]))
        elif len(path) >= 4 and path[:2] == ("optimizer", GROUP_META):
            meta_keys[key] = path
    values = read_objects(source, list(meta_keys))
    meta: dict[str, dict[str, Any]] = {}
    for key, path in meta_keys.items():
        meta.setdefault(str(path[2]), {})[str(path[3])] = values[key]
    plan = plan_group_meta_load(state_dict["optimizer"], fields, meta)
    renamed: dict[str, Any] = {key: values[key] for key in meta_keys}
    back: dict[str, ObjPath] = {}
    for key, value in flat.items():
        path = paths[key]
        if path[:2] == ("optimizer", "param_groups"):
            continue  # Megatron keeps none: finish() sets the fields from param_to_group_meta
        target = path
        if len(path) == 2 and path[0] == "model":
            target = ("model", theirs(str(path[1])))
        elif len(path) >= 4 and path[:2] == ("optimizer", "state"):
            name = str(path[2])
            if path[3] == "step" and name in plan.steps_from_meta:
                continue  # finish() sets it from the group fields
            target = ("optimizer", "state", plan.their_name.get(name, name), *path[3:])
        renamed[key_of(target)] = value
        back[key_of(target)] = path
    return KeyPlan(
        naming,
        renamed,
        {str(k) for k in state_dict},
        back,
        finish=lambda ours_state: plan.finish(ours_state["optimizer"]),
    )


def _translate(path: ObjPath, theirs: Callable[[str], str], position: Mapping[str, int]) -> ObjPath:
    if len(path) == 2 and path[0] == "model":
        return ("model", theirs(str(path[1])))
    if len(path) >= 3 and path[:2] == ("optimizer", "state"):
        name = str(path[2])
        key: str | int = position[name] if position else theirs(name)
        return ("optimizer", "state", key, *path[3:])
    return path


def _our_groups(optimizer: Any) -> list[list[str]] | None:
    """The parameter names of each of our optimizer's groups; None unless our optimizer state
    is keyed by name (``enable_dcp``'s hooks)."""
    if not isinstance(optimizer, Mapping):
        return None
    groups = optimizer.get("param_groups")
    if not isinstance(groups, list) or not groups:
        return None
    names = [list(g.get("params", [])) for g in groups if isinstance(g, Mapping)]
    if not all(isinstance(n, str) for group in names for n in group):
        return None
    return [[str(n) for n in group] for group in names]


def _writer_groups(metadata: Metadata, source: Path) -> list[list[Any]]:
    keys = {
        int(path[2]): key
        for key, path in paths_of(metadata).items()
        if len(path) == 4 and path[:2] == ("optimizer", "param_groups") and path[3] == "params"
    }
    values = read_objects(source, [keys[g] for g in sorted(keys)])
    return [list(values[keys[g]]) for g in sorted(keys)]


def _saved_shapes(metadata: Metadata) -> tuple[dict[str, Shape], dict[int, list[Shape]]]:
    """The shape of each model tensor the checkpoint holds (by its name), and those of each
    position's non-scalar state tensors."""
    model: dict[str, Shape] = {}
    states: dict[int, list[Shape]] = {}
    for key, path in paths_of(metadata).items():
        entry = metadata.state_dict_metadata[key]
        positional = len(path) >= 4 and path[:2] == ("optimizer", "state") and is_position(path[2])
        if not isinstance(entry, TensorStorageMetadata):
            continue
        if len(path) == 2 and path[0] == "model":
            model[str(path[1])] = tuple(entry.size)
        elif positional and len(entry.size) > 0:
            states.setdefault(int(path[2]), []).append(tuple(entry.size))
    return model, states


def _check_named_groups(
    our_groups: list[list[str]], writer_groups: list[list[Any]], theirs: Callable[[str], str]
) -> None:
    if len(writer_groups) != len(our_groups):
        raise StateDictMismatchError(
            f"the checkpoint's optimizer has {len(writer_groups)} parameter groups, this "
            f"optimizer {len(our_groups)}; build the optimizer with the writer's groups"
        )
    for number, (mine, written) in enumerate(zip(our_groups, writer_groups, strict=True)):
        missing = sorted({theirs(n) for n in mine} - {str(n) for n in written})
        unexpected = sorted({str(n) for n in written} - {theirs(n) for n in mine})
        if missing or unexpected:
            raise StateDictMismatchError(
                f"parameter group {number} of the checkpoint's optimizer holds other "
                f"parameters: missing {missing[:10]}, unexpected {unexpected[:10]}"
            )
