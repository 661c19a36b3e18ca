"""Convert between a DCP directory, one torch file and one safetensors file; describe them.

Conversions run in one process and keep DCP's flattened key scheme, the nesting of the
original state dict and its non-tensor values, so DCP -> safetensors -> DCP gives back every
tensor bit for bit. ``select`` and ``strip_prefixes`` flatten the nesting, as the consumers
they serve (Hugging Face, a plain ``load_state_dict``) expect flat names.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch
from torch.distributed.checkpoint._nested_dict import unflatten_state_dict

from mfsdp_checkpoint.atomic import save
from mfsdp_checkpoint.errors import CheckpointError
from mfsdp_checkpoint.marker import verify_files
from mfsdp_checkpoint.naming import detect_naming
from mfsdp_checkpoint.safetensors_io import TensorSpec, write_safetensors
from mfsdp_checkpoint.sources import (
    MAPPING_KEY,
    OBJECTS_KEY,
    DCPReader,
    Entry,
    Reader,
    encode_object,
    open_reader,
)
from mfsdp_checkpoint.wrapper_prefix import rename_model

Format = Literal["dcp", "torch", "safetensors"]
FORMATS: tuple[Format, ...] = ("dcp", "torch", "safetensors")


@dataclass(frozen=True)
class Renamed:
    """An entry of the source under the name and nested path it gets in the output."""

    entry: Entry
    key: str
    path: tuple[str | int, ...]


def _rename(
    entries: Sequence[Entry], select: str | None, strip_prefixes: Sequence[str]
) -> list[Renamed]:
    if select is None and not strip_prefixes:
        return [Renamed(e, e.key, e.path) for e in entries]
    out = []
    for entry in entries:
        key = entry.key
        if select is not None:
            if not entry.path or str(entry.path[0]) != select:
                continue
            key = ".".join(str(p) for p in entry.path[1:])
        for prefix in strip_prefixes:
            key = rename_model(key, prefix, "")
        out.append(Renamed(entry, key, (key,)))
    if select is not None and not out:
        sections = sorted({str(e.path[0]) for e in entries if e.path})
        raise CheckpointError(f"select={select!r} matches nothing; the sections are {sections}")
    if len({r.key for r in out}) != len(out):
        raise CheckpointError("renaming made two entries share a name; strip less")
    return out


def _read_all(reader: Reader, items: list[Renamed]) -> dict[str, Any]:
    tensors = [r for r in items if r.entry.is_tensor]
    values: dict[str, Any] = {}
    by_source = {r.entry.key: r for r in tensors}
    for key, tensor in reader.tensors([r.entry.key for r in tensors]):
        values[by_source[key].key] = tensor
    for item in items:
        if not item.entry.is_tensor:
            values[item.key] = reader.object(item.entry.key)
    return values


def _nested(items: list[Renamed], values: dict[str, Any]) -> dict[str, Any]:
    mappings = {r.key: r.path for r in items}
    flat = {r.key: values[r.key] for r in items}
    nested: dict[str, Any] = unflatten_state_dict(flat, mappings)
    return nested


def _write_safetensors(reader: Reader, items: list[Renamed], dst: Path) -> None:
    tensors = [r for r in items if r.entry.is_tensor]
    specs = []
    for item in tensors:
        assert item.entry.shape is not None and item.entry.dtype is not None
        specs.append(TensorSpec(item.key, item.entry.shape, item.entry.dtype))
    metadata = {"format": "pt"}
    if any(r.path != (r.key,) for r in items):
        metadata[MAPPING_KEY] = _json({r.key: list(r.path) for r in items})
    objects = {
        r.key: encode_object(reader.object(r.entry.key)) for r in items if not r.entry.is_tensor
    }
    if objects:
        metadata[OBJECTS_KEY] = _json(objects)
    stream = (t for _, t in reader.tensors([r.entry.key for r in tensors]))
    write_safetensors(dst, specs, stream, metadata)


def _json(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"))


def convert(
    src: str | Path,
    dst: str | Path,
    to: Format,
    *,
    select: str | None = None,
    strip_prefixes: Sequence[str] = (),
    allow_pickle: bool = False,
) -> Path:
    """Convert the checkpoint at ``src`` (any format) to ``to`` at ``dst``; return ``dst``."""
    if to not in FORMATS:
        raise ValueError(f"to must be one of {FORMATS}, got {to!r}")
    source, target = Path(src), Path(dst)
    reader = open_reader(source, allow_pickle=allow_pickle)
    items = _rename(reader.entries, select, strip_prefixes)
    if to == "safetensors":
        _write_safetensors(reader, items, target)
    elif to == "torch":
        nested = _nested(items, _read_all(reader, items))
        tmp = target.with_name(target.name + ".tmp")
        torch.save(nested, tmp)
        tmp.replace(target)
    else:
        save(_nested(items, _read_all(reader, items)), target)
    return target


def describe(
    src: str | Path, *, verify: bool = False, allow_pickle: bool = False
) -> dict[str, Any]:
    """Keys, shapes, dtypes, sizes and, for DCP, the world size a checkpoint was saved with and
    which writer names its keys how (``writer``, ``naming``: see ``naming.detect_naming``)."""
    source = Path(src)
    reader = open_reader(source, allow_pickle=allow_pickle)
    tensors = [
        {
            "key": e.key,
            "shape": list(e.shape),
            "dtype": str(e.dtype).replace("torch.", ""),
            "bytes": e.nbytes,
        }
        for e in reader.entries
        if e.is_tensor and e.shape is not None
    ]
    report: dict[str, Any] = {
        "path": str(source),
        "format": reader.format,
        "tensors": tensors,
        "objects": [e.key for e in reader.entries if not e.is_tensor],
        "total_bytes": sum(t["bytes"] for t in tensors),
        "world_size": None,
        "complete": True,
    }
    if isinstance(reader, DCPReader):
        marker = reader.info.marker
        naming = detect_naming(reader.metadata, has_marker=marker is not None)
        report["writer"] = naming.writer
        report["naming"] = {
            "model_prefix": naming.model_prefix,
            "optimizer_state": naming.optimizer_keys,
        }
        if marker is not None:
            report["world_size"] = marker.get("world_size")
            report["saved_with_torch"] = marker.get("torch")
        else:
            ranks = {
                int(m.group(1))
                for f in source.iterdir()
                if (m := re.match(r"__(\d+)_\d+\.distcp$", f.name))
            }
            report["world_size"] = f">= {max(ranks) + 1} (no completion marker)" if ranks else None
            report["complete"] = "unknown (plain DCP directory, no completion marker)"
        if verify:
            verify_files(reader.info, (0, 1), checksums=True)
            report["verified"] = marker is not None
    return report
