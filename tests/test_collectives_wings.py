"""Layer 2's wings: each subpackage of ``mfsdp_collectives`` imports only wings ranked below
it (or itself), no module sits outside a wing but the package's ``__init__``, and every wing
has a rank. The package imports itself relatively, so relative imports count as well."""

from __future__ import annotations

import ast
from pathlib import Path

from wings import wing_violations as package_wing_violations

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = "mfsdp_collectives"
COLLECTIVES = ROOT / "packages" / "mfsdp-collectives" / "src" / PACKAGE
# Bottom first: a wing may import only wings of a strictly lower rank.
WING_RANK = {
    "core": 1,
    "safety": 2,
    "tracing": 3,
    "host": 4,
    "topology": 5,
    "issuing": 6,
    "comms": 7,
    "ops": 8,
    "testing": 9,
}


def wing_violations(package_dir: Path) -> list[str]:
    return package_wing_violations(package_dir, PACKAGE, WING_RANK)


def test_wings_import_only_wings_below() -> None:
    assert wing_violations(COLLECTIVES) == []


def test_every_wing_has_a_folder_and_a_docstring() -> None:
    for wing in WING_RANK:
        init = COLLECTIVES / wing / "__init__.py"
        assert init.is_file(), f"{wing}: no {init}"
        assert ast.get_docstring(ast.parse(init.read_text())), f"{wing}: say what it owns"


def test_wing_check_catches_upward_imports_and_a_stray_module(tmp_path: Path) -> None:
    (tmp_path / "host").mkdir()
    (tmp_path / "host" / "shm.py").write_text(
        "from ..core.naming import group_name\n"
        "from .shm_lane import Lane\n"
        "from . import _futex\n"
        "from ..ops.flat_ops import all_gather_into\n"
        "from mfsdp_collectives.issuing.handle import CommHandle\n"
        "from .. import all_reduce_\n"
        "import mfsdp_collectives\n"
    )
    (tmp_path / "stray.py").write_text("x = 1\n")
    (tmp_path / "misc").mkdir()
    (tmp_path / "misc" / "__init__.py").write_text("")
    assert wing_violations(tmp_path) == [
        "host/shm.py:4: -> mfsdp_collectives.ops.flat_ops",
        "host/shm.py:5: -> mfsdp_collectives.issuing.handle",
        "host/shm.py:6: -> mfsdp_collectives",
        "host/shm.py:7: -> mfsdp_collectives",
        "misc: a wing without a rank",
        "stray.py: a module outside the wings",
    ]
