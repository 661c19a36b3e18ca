"""safetensors files written one tensor at a time and read through ``mmap``.

``safetensors.torch.save_file`` needs every tensor in memory at once, which defeats exporting a
model that only fits in memory sharded. The format is simple (an 8-byte header length, a JSON
header with each tensor's dtype, shape and byte range, then the raw bytes), so the writer emits
the header from shapes alone and streams the data. The reader validates the file with the
``safetensors`` library, then maps it copy-on-write: tensors are zero-copy views whose pages are
read only when touched, so taking a few rows of a huge tensor reads only those rows.
"""

from __future__ import annotations

import json
import math
import mmap
import os
import struct
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from mfsdp_checkpoint.errors import CorruptCheckpointError

DTYPE_CODES: dict[torch.dtype, str] = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
    torch.uint16: "U16",
    torch.uint32: "U32",
    torch.uint64: "U64",
    torch.complex64: "C64",
}
DTYPES_BY_CODE = {code: dtype for dtype, code in DTYPE_CODES.items()}


@dataclass(frozen=True)
class TensorSpec:
    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


def _header(specs: Sequence[TensorSpec], metadata: dict[str, str]) -> bytes:
    header: dict[str, object] = {"__metadata__": metadata}
    offset = 0
    for spec in specs:
        if spec.dtype not in DTYPE_CODES:
            raise TypeError(f"{spec.name}: dtype {spec.dtype} has no safetensors encoding")
        header[spec.name] = {
            "dtype": DTYPE_CODES[spec.dtype],
            "shape": list(spec.shape),
            "data_offsets": [offset, offset + spec.nbytes],
        }
        offset += spec.nbytes
    blob = json.dumps(header, separators=(",", ":")).encode()
    return blob + b" " * (-len(blob) % 8)


def _raw_bytes(tensor: torch.Tensor) -> memoryview:
    flat = tensor.detach().to("cpu").contiguous().reshape(-1)
    return flat.view(torch.uint8).numpy().data


def write_safetensors(
    path: Path,
    specs: Sequence[TensorSpec],
    tensors: Iterable[torch.Tensor],
    metadata: dict[str, str] | None = None,
) -> None:
    """Write ``tensors`` (in ``specs`` order, each matching its spec) to ``path`` atomically."""
    if len({s.name for s in specs}) != len(specs):
        raise ValueError("safetensors: tensor names must be unique")
    header = _header(specs, metadata or {})
    tmp = path.with_name(path.name + ".tmp")
    with tmp.open("wb") as handle:
        handle.write(struct.pack("<Q", len(header)))
        handle.write(header)
        for spec, tensor in zip(specs, tensors, strict=True):
            if tuple(tensor.shape) != spec.shape or tensor.dtype != spec.dtype:
                raise ValueError(
                    f"safetensors: {spec.name} is {tuple(tensor.shape)} {tensor.dtype}, its "
                    f"header says {spec.shape} {spec.dtype}"
                )
            if spec.nbytes:
                handle.write(_raw_bytes(tensor))
        handle.flush()
        os.fsync(handle.fileno())
    tmp.replace(path)


class SafetensorsFile:
    """A safetensors file mapped into memory; ``tensor(name)`` costs no read until used."""

    def __init__(self, path: Path) -> None:
        self.path = path
        try:
            with safe_open(str(path), framework="pt") as checked:
                self.metadata: dict[str, str] = dict(checked.metadata() or {})
        except Exception as error:
            raise CorruptCheckpointError(
                f"{path} is not a valid safetensors file: {error}"
            ) from None
        with path.open("rb") as handle:
            (length,) = struct.unpack("<Q", handle.read(8))
            header = json.loads(handle.read(length))
            self._data_start = 8 + length
            size = os.fstat(handle.fileno()).st_size
            self._map = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_COPY) if size else None
        header.pop("__metadata__", None)
        self.specs: dict[str, TensorSpec] = {}
        self._offsets: dict[str, int] = {}
        for name, info in sorted(header.items(), key=lambda item: item[1]["data_offsets"][0]):
            dtype = DTYPES_BY_CODE.get(info["dtype"])
            if dtype is None:
                raise CorruptCheckpointError(
                    f"{path}: {name} has unsupported dtype {info['dtype']}"
                )
            self.specs[name] = TensorSpec(name, tuple(info["shape"]), dtype)
            self._offsets[name] = info["data_offsets"][0]

    def tensor(self, name: str) -> torch.Tensor:
        spec = self.specs[name]
        numel = math.prod(spec.shape)
        if numel == 0 or self._map is None:
            return torch.empty(spec.shape, dtype=spec.dtype)
        flat = torch.frombuffer(
            self._map,
            dtype=torch.uint8,
            count=spec.nbytes,
            offset=self._data_start + self._offsets[name],
        )
        return flat.view(spec.dtype).reshape(spec.shape)
