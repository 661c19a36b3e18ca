"""``megatron_fsdp`` reaches the layers below only through their public faces: the names each
package's ``__init__`` lists in ``__all__``. No submodule import (``from mfsdp_hooks.runtime.unit
import FSDPUnit``, ``import mfsdp_hooks.testing``), no private or unlisted name (``from
mfsdp_hooks import _x``, ``mfsdp_hooks._x``). What the meta-package needs of the engine is
then a public, documented name the engine owns, and the engine may rearrange its insides.
Read from the sources with ``ast``: nothing is imported.
"""

from __future__ import annotations

import ast
import importlib.util
from pathlib import Path

import pytest

LAYERS = ["mfsdp_buffers", "mfsdp_collectives", "mfsdp_hooks", "mfsdp_checkpoint", "mfsdp_te"]


def _source(package: str) -> Path:
    """The package's directory, found without importing it."""
    spec = importlib.util.find_spec(package)
    assert spec is not None and spec.origin is not None, package
    return Path(spec.origin).parent


def public_names(init: Path) -> set[str]:
    """What ``__init__.py`` lists in ``__all__`` (``=`` and ``+=`` of literal lists)."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(init.read_text(), filename=str(init))):
        target = None
        if isinstance(node, ast.Assign) and len(node.targets) == 1:
            target = node.targets[0]
        elif isinstance(node, ast.AugAssign):
            target = node.target
        if isinstance(target, ast.Name) and target.id == "__all__":
            assert isinstance(node.value, (ast.List, ast.Tuple)), f"{init}: __all__ not literal"
            names |= {ast.literal_eval(element) for element in node.value.elts}
    return names


def surface_violations(sources: Path, package: str, public: set[str]) -> list[str]:
    """Every import of ``package`` under ``sources`` that is not one of its ``public`` names."""
    bad = []
    for path in sorted(sources.rglob("*.py")):
        tree = ast.parse(path.read_text(), filename=str(path))
        where = path.relative_to(sources)
        aliases = set()  # local names bound to the package itself
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name.startswith(f"{package}."):
                        bad.append(f"{where}:{node.lineno}: import {alias.name}")
                    elif alias.name == package:
                        aliases.add(alias.asname or package)
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                if node.module.startswith(f"{package}."):
                    bad.append(f"{where}:{node.lineno}: from {node.module} import ...")
                elif node.module == package:
                    bad += [
                        f"{where}:{node.lineno}: from {package} import {alias.name}"
                        for alias in node.names
                        if alias.name not in public
                    ]
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Attribute)
                and isinstance(node.value, ast.Name)
                and node.value.id in aliases
                and node.attr not in public
            ):
                bad.append(f"{where}:{node.lineno}: {package}.{node.attr}")
    return bad


@pytest.mark.parametrize("package", LAYERS)
def test_megatron_fsdp_uses_only_the_public_names_of(package: str) -> None:
    public = public_names(_source(package) / "__init__.py")
    assert surface_violations(_source("megatron_fsdp"), package, public) == []


def test_surface_check_catches_submodules_and_unlisted_names(tmp_path: Path) -> None:
    (tmp_path / "plan").mkdir()
    (tmp_path / "plan" / "bad.py").write_text(
        "import mfsdp_hooks\n"
        "import mfsdp_hooks.testing\n"
        "from mfsdp_hooks.runtime.unit import FSDPUnit\n"
        "from mfsdp_hooks import fully_shard, _private, unlisted\n"
        "import mfsdp_hooks as hooks\n"
        "x = hooks._peek, mfsdp_hooks.fully_shard, mfsdp_hooks.runtime\n"
    )
    assert surface_violations(tmp_path, "mfsdp_hooks", {"fully_shard"}) == [
        "plan/bad.py:2: import mfsdp_hooks.testing",
        "plan/bad.py:3: from mfsdp_hooks.runtime.unit import ...",
        "plan/bad.py:4: from mfsdp_hooks import _private",
        "plan/bad.py:4: from mfsdp_hooks import unlisted",
        "plan/bad.py:6: mfsdp_hooks._peek",
        "plan/bad.py:6: mfsdp_hooks.runtime",
    ]
    assert public_names(_source("mfsdp_hooks") / "__init__.py") >= {"fully_shard", "FSDPModule"}
