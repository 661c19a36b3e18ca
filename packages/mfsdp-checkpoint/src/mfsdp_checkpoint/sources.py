"""One read interface over the three checkpoint formats: DCP directory, torch file, safetensors.

A ``Reader`` lists its entries under DCP's flattened key scheme (``"model.embed.weight"``,
``"optimizer.param_groups"``), each with the nested path it came from, so conversions keep the
structure and every format names a tensor the same way. Tensors are read lazily: torch files
and safetensors through ``mmap`` (only touched pages are read), DCP directories in batches.
"""

from __future__ import annotations

import base64
import io
import json
import math
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint._nested_dict import flatten_state_dict
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.filesystem import FileSystemReader
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load

from mfsdp_checkpoint import _dist
from mfsdp_checkpoint.atomic import read_metadata
from mfsdp_checkpoint.errors import CheckpointNotFoundError, CorruptCheckpointError
from mfsdp_checkpoint.marker import DCP_METADATA, inspect_directory
from mfsdp_checkpoint.safetensors_io import SafetensorsFile

ObjPath = tuple[str | int, ...]
MAPPING_KEY = "mfsdp.mapping"
OBJECTS_KEY = "mfsdp.objects"
_BATCH_BYTES = 256 << 20
HF_INDEX = "model.safetensors.index.json"  # Hugging Face's map of a split model's weights


@dataclass(frozen=True)
class Entry:
    """One leaf of a checkpoint: a tensor (shape, dtype) or a pickled object."""

    key: str
    path: ObjPath
    shape: tuple[int, ...] | None
    dtype: torch.dtype | None

    @property
    def is_tensor(self) -> bool:
        return self.shape is not None

    @property
    def nbytes(self) -> int:
        if self.shape is None or self.dtype is None:
            return 0
        return math.prod(self.shape) * self.dtype.itemsize


class Reader:
    """Entries of a checkpoint and lazy access to their values."""

    format = "unknown"
    entries: list[Entry]

    def tensor(self, key: str) -> torch.Tensor:
        raise NotImplementedError

    def object(self, key: str) -> Any:
        raise NotImplementedError

    def tensors(self, keys: Sequence[str]) -> Iterator[tuple[str, torch.Tensor]]:
        """``(key, tensor)`` in ``keys`` order; formats that read in batches override this."""
        for key in keys:
            yield key, self.tensor(key)


def encode_object(value: Any) -> str:
    buffer = io.BytesIO()
    torch.save(value, buffer)
    return base64.b64encode(buffer.getvalue()).decode()


def decode_object(text: str) -> Any:
    return torch.load(io.BytesIO(base64.b64decode(text)), weights_only=False)


class NestedReader(Reader):
    """Any nested mapping of tensors and objects (what ``torch.load`` returns)."""

    format = "mapping"

    def __init__(self, state: Mapping[str, Any]) -> None:
        flat, mappings = flatten_state_dict(dict(state))
        self._flat = flat
        self.entries = [
            Entry(k, tuple(mappings[k]), tuple(v.shape), v.dtype)
            if isinstance(v, torch.Tensor)
            else Entry(k, tuple(mappings[k]), None, None)
            for k, v in flat.items()
        ]

    def tensor(self, key: str) -> torch.Tensor:
        value = self._flat[key]
        assert isinstance(value, torch.Tensor)
        return value

    def object(self, key: str) -> Any:
        return self._flat[key]


class TorchFileReader(NestedReader):
    """A ``torch.save`` file, memory-mapped (only the rows you touch are read)."""

    format = "torch"

    def __init__(self, path: Path, allow_pickle: bool = False) -> None:
        try:
            state = torch.load(path, mmap=True, map_location="cpu", weights_only=not allow_pickle)
        except RuntimeError as error:
            if "mmap" in str(error) or "zipfile" in str(error):  # legacy format: no mmap
                state = torch.load(path, map_location="cpu", weights_only=not allow_pickle)
            else:
                raise CorruptCheckpointError(f"{path} cannot be read: {error}") from None
        except Exception as error:
            raise CorruptCheckpointError(
                f"{path} cannot be read as a torch file ({type(error).__name__}: {error}); if it "
                "holds pickled objects you trust, pass allow_pickle=True (--allow-pickle)"
            ) from None
        if not isinstance(state, Mapping):
            raise CorruptCheckpointError(f"{path} holds a {type(state).__name__}, not a dict")
        super().__init__(state)


class SafetensorsReader(Reader):
    """A safetensors file; our conversions also restore nesting and objects from its metadata."""

    format = "safetensors"

    def __init__(self, path: Path) -> None:
        self.file = SafetensorsFile(path)
        meta = self.file.metadata
        mapping = json.loads(meta[MAPPING_KEY]) if MAPPING_KEY in meta else {}
        self._objects: dict[str, str] = json.loads(meta[OBJECTS_KEY]) if OBJECTS_KEY in meta else {}
        self.entries = [
            Entry(name, tuple(mapping.get(name, [name])), spec.shape, spec.dtype)
            for name, spec in self.file.specs.items()
        ]
        self.entries += [
            Entry(key, tuple(mapping.get(key, [key])), None, None) for key in self._objects
        ]
        order = {key: n for n, key in enumerate(mapping)}
        self.entries.sort(key=lambda e: order.get(e.key, len(order)))

    def tensor(self, key: str) -> torch.Tensor:
        return self.file.tensor(key)

    def object(self, key: str) -> Any:
        return decode_object(self._objects[key])


class SafetensorsDirectoryReader(Reader):
    """A Hugging Face model directory: weights split over ``*.safetensors`` files (named by
    ``model.safetensors.index.json`` when present), read file by file through mmap."""

    format = "safetensors"

    def __init__(self, path: Path) -> None:
        index = path / HF_INDEX
        if index.exists():
            weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
            names = sorted(set(weight_map.values()))
        else:
            names = sorted(p.name for p in path.glob("*.safetensors"))
        self._file_of: dict[str, SafetensorsReader] = {}
        self.entries = []
        for name in names:
            reader = SafetensorsReader(path / name)
            for entry in reader.entries:
                self._file_of[entry.key] = reader
                self.entries.append(entry)

    def tensor(self, key: str) -> torch.Tensor:
        return self._file_of[key].tensor(key)

    def object(self, key: str) -> Any:
        return self._file_of[key].object(key)


class DCPReader(Reader):
    """A DCP directory read in a single process, a batch of tensors per ``dcp.load``."""

    format = "dcp"

    def __init__(self, path: Path) -> None:
        self.path = path
        self.info = inspect_directory(path)
        self.metadata = read_metadata(path)
        planner_data = self.metadata.planner_data
        mappings = planner_data if isinstance(planner_data, dict) else {}
        self.entries = []
        for key, md in self.metadata.state_dict_metadata.items():
            path_of = tuple(mappings.get(key, (key,)))
            if isinstance(md, TensorStorageMetadata):
                self.entries.append(Entry(key, path_of, tuple(md.size), md.properties.dtype))
            else:
                self.entries.append(Entry(key, path_of, None, None))

    def _load(self, state: dict[str, Any]) -> dict[str, Any]:
        try:
            with _dist.quiet_single_process():
                dcp_load(
                    state,
                    storage_reader=FileSystemReader(self.path),
                    planner=DefaultLoadPlanner(allow_partial_load=True),
                    no_dist=True,
                )
        except (CheckpointException, Exception) as error:  # the former is a BaseException
            raise CorruptCheckpointError(f"reading {self.path} failed: {error}") from None
        return state

    def tensor(self, key: str) -> torch.Tensor:
        return next(self.tensors([key]))[1]

    def tensors(self, keys: Sequence[str]) -> Iterator[tuple[str, torch.Tensor]]:
        entries = {e.key: e for e in self.entries}
        batch: list[str] = []
        size = 0
        for key in [*keys, None]:
            if key is not None:
                batch.append(key)
                size += entries[key].nbytes
            if batch and (key is None or size >= _BATCH_BYTES):
                state: dict[str, Any] = {}
                for name in batch:
                    entry = entries[name]
                    assert entry.shape is not None and entry.dtype is not None
                    state[name] = torch.empty(entry.shape, dtype=entry.dtype)
                loaded = self._load(state)
                for name in batch:
                    yield name, loaded[name]
                batch, size = [], 0

    def object(self, key: str) -> Any:
        return self._load({key: None})[key]


def open_reader(path: Path, allow_pickle: bool = False) -> Reader:
    """The reader of what is at ``path``: a DCP directory, a Hugging Face model directory of
    ``*.safetensors`` files, a safetensors file or a torch file."""
    if not path.exists():
        raise CheckpointNotFoundError(f"no checkpoint at {path}")
    if path.is_dir():
        if not (path / DCP_METADATA).exists() and (
            (path / HF_INDEX).exists() or any(path.glob("*.safetensors"))
        ):
            return SafetensorsDirectoryReader(path)
        return DCPReader(path)
    with path.open("rb") as handle:
        head = handle.read(16)
    if path.suffix == ".safetensors" or (len(head) >= 9 and head[8:9] == b"{"):
        return SafetensorsReader(path)
    return TorchFileReader(path, allow_pickle=allow_pickle)
