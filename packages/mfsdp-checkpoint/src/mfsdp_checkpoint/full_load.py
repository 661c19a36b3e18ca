"""Load a full, non-distributed state dict (a torch file, a safetensors file or an in-memory
dict) into a sharded model, one parameter at a time, without any rank materialising the whole
model (the two modes: the package README, "Full state dicts in and out").

Keys are matched after ``strip_prefix`` is removed from the model's names and ``source_prefix``
is added (``strip_prefix="module."`` loads a plain model's file into ``MegatronFSDP``).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, NamedTuple

import torch
import torch.distributed as dist
from torch import nn

from mfsdp_checkpoint import _dist
from mfsdp_checkpoint.errors import CheckpointError
from mfsdp_checkpoint.model_hooks import mark_dirty
from mfsdp_checkpoint.param_index import ParamIndex
from mfsdp_checkpoint.sources import NestedReader, Reader, open_reader
from mfsdp_checkpoint.validate import summarize
from mfsdp_checkpoint.wrapper_prefix import WRAPPER_PREFIX, rename_model
from mfsdp_hooks import ParameterGroup, local_tensor

Source = str | os.PathLike[str] | Mapping[str, Any]


class FullLoadResult(NamedTuple):
    missing_keys: list[str]
    unexpected_keys: list[str]


@dataclass
class _Plan:
    """Which source key feeds each parameter / buffer, decided before any tensor is read.

    Picklable (names only), so rank 0 can decide it and broadcast it in ``broadcast`` mode.
    """

    params: list[tuple[str, str]] = field(default_factory=list)
    others: list[tuple[str, str]] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)
    unexpected: list[str] = field(default_factory=list)
    mismatched: list[str] = field(default_factory=list)
    shapes: dict[str, tuple[tuple[int, ...], torch.dtype]] = field(default_factory=dict)
    hint: str = ""

    def problem(self, strict: bool) -> str | None:
        listed = summarize(
            [
                ("missing from the source", self.missing if strict else []),
                ("unexpected in the source", self.unexpected if strict else []),
                ("shape mismatches", self.mismatched),
            ]
        )
        return (
            f"the full state dict does not match the model: {listed}{self.hint}" if listed else None
        )


def _plan(model: nn.Module, reader: Reader, strip_prefix: str, source_prefix: str) -> _Plan:
    index = ParamIndex(model)
    entries = {e.key: e for e in reader.entries if e.is_tensor}
    plan = _Plan()
    used: set[str] = set()

    def check_shape(key: str, src: str, shape: tuple[int, ...]) -> bool:
        entry = entries[src]
        assert entry.shape is not None and entry.dtype is not None
        plan.shapes[src] = (entry.shape, entry.dtype)
        if entry.shape != shape:
            plan.mismatched.append(f"{key} (source {src} {entry.shape}, model {shape})")
            return False
        return True

    for ref in index.refs():
        names = index.aliases[ref.fqn]
        found = [(n, rename_model(n, strip_prefix, source_prefix)) for n in names]
        present = [(n, s) for n, s in found if s in entries]
        used.update(s for _, s in present)
        if not present:
            plan.missing.append(names[0])
        elif check_shape(present[0][0], present[0][1], tuple(ref.param.shape)):
            plan.params.append((ref.fqn, present[0][1]))
    for key, value in model.state_dict().items():
        if key in index.by_name or not isinstance(value, torch.Tensor):
            continue
        src = rename_model(key, strip_prefix, source_prefix)
        if src not in entries:
            plan.missing.append(key)
            continue
        used.add(src)
        if check_shape(key, src, tuple(value.shape)):
            plan.others.append((key, src))
    plan.unexpected = sorted(k for k in entries if k not in used and k.startswith(source_prefix))
    if (
        plan.missing
        and not used
        and strip_prefix == ""
        and any(k.startswith(WRAPPER_PREFIX) for k in index.by_name)
    ):
        plan.hint = (
            " (no key matched: the model's names start with 'module.'; pass strip_prefix='module.')"
        )
    return plan


def load_full_state_dict(
    model: nn.Module,
    source: Source,
    *,
    strict: bool = True,
    strip_prefix: str = "",
    source_prefix: str = "",
    mode: Literal["mmap", "broadcast"] = "mmap",
    allow_pickle: bool = False,
) -> FullLoadResult:
    """Copy a full state dict into the sharded ``model`` (main weights; compute weights follow
    at the next unshard). Collective. Raises ``StateDictMismatchError`` on every rank when keys
    are missing or unexpected (``strict``) or shapes differ; tied names count as one parameter.
    """
    if mode not in ("mmap", "broadcast"):
        raise ValueError(f"mode must be 'mmap' or 'broadcast', got {mode!r}")
    reads = mode == "mmap" or _dist.rank() == 0
    reader: Reader | None = None
    plan: _Plan | None = None
    problem: _dist.Problem = None
    if reads:
        try:
            if isinstance(source, Mapping):
                reader = NestedReader(source)
            else:
                reader = open_reader(Path(source), allow_pickle=allow_pickle)
            plan = _plan(model, reader, strip_prefix, source_prefix)
            message = plan.problem(strict)
            if message:
                problem = ("StateDictMismatchError", message)
        except CheckpointError as error:
            problem = _dist.problem_of(error)
    _dist.agree(problem)
    if mode == "broadcast" and _dist.is_distributed():
        box: list[Any] = [plan]
        dist.broadcast_object_list(box, src=0)
        plan = box[0]
    assert plan is not None
    buffers = model.state_dict(keep_vars=True)
    index = ParamIndex(model)
    touched: dict[int, ParameterGroup] = {}
    for name, src in plan.params:
        ref = index.by_name[name]
        local = local_tensor(ref.param)
        full = _fetch(reader, src, plan, local.device, mode)
        with torch.no_grad():
            local.copy_(ref.chunk.rows_of(full))
        touched.setdefault(id(ref.group), ref.group)
        del full
    for key, src in plan.others:
        full = _fetch(reader, src, plan, buffers[key].device, mode)
        with torch.no_grad():
            buffers[key].copy_(full)
    mark_dirty(list(touched.values()))
    return FullLoadResult(plan.missing, plan.unexpected)


def _fetch(
    reader: Reader | None, key: str, plan: _Plan, device: torch.device, mode: str
) -> torch.Tensor:
    """The full source tensor ``key`` (lazily mapped in mmap mode, broadcast otherwise)."""
    if mode == "mmap" or not _dist.is_distributed():
        assert reader is not None
        return reader.tensor(key)
    shape, dtype = plan.shapes[key]
    if _dist.rank() == 0:
        assert reader is not None
        full = reader.tensor(key).to(device=device, copy=True).contiguous()
    else:
        full = torch.empty(shape, dtype=dtype, device=device)
    dist.broadcast(full, src=0)
    return full
