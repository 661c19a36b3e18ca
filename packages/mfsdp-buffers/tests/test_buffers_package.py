"""Package surface: exports, version, and the layer-1 rules (torch only, no hard-coded device)."""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

import mfsdp_buffers

SRC = Path(mfsdp_buffers.__file__).resolve().parent


def test_version_and_exports() -> None:
    assert mfsdp_buffers.__version__ == "1.0.0"
    for name in mfsdp_buffers.__all__:
        assert getattr(mfsdp_buffers, name) is not None, name
    for name in [
        "FlatLayout",
        "ParamPlacement",
        "LocalPiece",
        "DataParallelBuffer",
        "BufferRole",
        "BucketKey",
        "Bucket",
        "build_buckets",
        "Allocator",
        "PlainAllocator",
        "StorageResizeAllocator",
        "FixedPoolAllocator",
        "TracePoolAllocator",
    ]:
        assert name in mfsdp_buffers.__all__, name


def test_depends_on_torch_only() -> None:
    for path in sorted(SRC.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                roots = [alias.name.split(".")[0] for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                roots = [node.module.split(".")[0]]
            else:
                continue
            for root in roots:
                ok = root in sys.stdlib_module_names or root in {"torch", "mfsdp_buffers"}
                assert ok, f"{path.name} imports {root}: layer 1 depends on torch only"


def test_no_hard_coded_accelerator() -> None:
    for path in sorted(SRC.rglob("*.py")):
        code = path.read_text()
        assert not re.search(r"[\"']cuda", code), f"{path.name} hard-codes cuda"
        assert "torch.cuda" not in code, f"{path.name} uses torch.cuda"
