"""Workspace invariants: exact pins in the meta-package and imports that only point down."""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

import pytest

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ROOT / "packages"
# Rank of each layer: a package may import only packages of a strictly lower rank.
LAYER_RANK = {
    "mfsdp_buffers": 1,
    "mfsdp_collectives": 2,
    "mfsdp_hooks": 3,
    "mfsdp_checkpoint": 4,
    "mfsdp_te": 4,
    "megatron_fsdp": 5,
}


def _project(dist_dir: str) -> dict[str, object]:
    data = tomllib.loads((PACKAGES / dist_dir / "pyproject.toml").read_text())
    project = data["project"]
    assert isinstance(project, dict)
    return project


def _imported_top_levels(path: Path) -> list[tuple[int, str]]:
    tree = ast.parse(path.read_text(), filename=str(path))
    found: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name.split(".")[0]) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.append((node.lineno, node.module.split(".")[0]))
    return found


def layering_violations(packages_dir: Path) -> list[str]:
    """Every import in a package's sources that points to a layer at or above its own."""
    bad = []
    for module, rank in LAYER_RANK.items():
        for path in sorted(packages_dir.glob(f"*/src/{module}/**/*.py")):
            for lineno, imported in _imported_top_levels(path):
                if imported in LAYER_RANK and imported != module and LAYER_RANK[imported] >= rank:
                    bad.append(f"{path.relative_to(packages_dir)}:{lineno}: {module} -> {imported}")
    return bad


def pin_mismatches(packages_dir: Path) -> list[str]:
    """Meta-package requirements that are not `==` the pinned package's current version."""
    versions = {
        tomllib.loads(p.read_text())["project"]["name"]: tomllib.loads(p.read_text())["project"][
            "version"
        ]
        for p in packages_dir.glob("*/pyproject.toml")
    }
    meta = tomllib.loads((packages_dir / "megatron-fsdp" / "pyproject.toml").read_text())
    requirements = list(meta["project"]["dependencies"])
    for extra in meta["project"].get("optional-dependencies", {}).values():
        requirements += extra
    problems = []
    pinned = set()
    for req in requirements:
        match = re.match(r"^([A-Za-z0-9_.-]+)(\[[^\]]*\])?\s*(.*)$", req)
        assert match, req
        name, spec = match.group(1), match.group(3).strip()
        if name not in versions or name == "megatron-fsdp":
            continue
        pinned.add(name)
        if spec != f"=={versions[name]}":
            problems.append(f"{name}: pinned '{spec}' but the package is {versions[name]}")
    for name in sorted(set(versions) - pinned - {"megatron-fsdp"}):
        problems.append(f"{name}: not pinned by megatron-fsdp")
    return problems


def test_six_packages_each_installable_with_readme_and_typed_marker() -> None:
    for dist_dir, module in [
        ("mfsdp-buffers", "mfsdp_buffers"),
        ("mfsdp-collectives", "mfsdp_collectives"),
        ("mfsdp-hooks", "mfsdp_hooks"),
        ("mfsdp-checkpoint", "mfsdp_checkpoint"),
        ("mfsdp-te", "mfsdp_te"),
        ("megatron-fsdp", "megatron_fsdp"),
    ]:
        project = _project(dist_dir)
        assert project["name"] == dist_dir
        assert (PACKAGES / dist_dir / "README.md").stat().st_size > 200
        assert (PACKAGES / dist_dir / "src" / module / "py.typed").exists()
        assert (PACKAGES / dist_dir / "tests").is_dir()


def test_meta_package_pins_every_layer_exactly() -> None:
    assert pin_mismatches(PACKAGES) == []


def test_pin_check_catches_a_drifted_version(tmp_path: Path) -> None:
    copy = tmp_path / "packages"
    for pyproject in PACKAGES.glob("*/pyproject.toml"):
        target = copy / pyproject.parent.name / "pyproject.toml"
        target.parent.mkdir(parents=True)
        target.write_text(pyproject.read_text())
    hooks = copy / "mfsdp-hooks" / "pyproject.toml"
    hooks.write_text(hooks.read_text().replace('version = "0.1.0"', 'version = "0.1.1"', 1))
    assert pin_mismatches(copy) == ["mfsdp-hooks: pinned '==0.1.0' but the package is 0.1.1"]


def test_dependencies_point_down_only() -> None:
    assert layering_violations(PACKAGES) == []


def test_layering_check_catches_an_upward_import(tmp_path: Path) -> None:
    src = tmp_path / "mfsdp-buffers" / "src" / "mfsdp_buffers"
    src.mkdir(parents=True)
    (src / "bad.py").write_text("import torch\nfrom mfsdp_hooks import fully_shard\n")
    assert layering_violations(tmp_path) == [
        "mfsdp-buffers/src/mfsdp_buffers/bad.py:2: mfsdp_buffers -> mfsdp_hooks"
    ]


@pytest.mark.parametrize("dist_dir", sorted(p.name for p in PACKAGES.iterdir() if p.is_dir()))
def test_declared_dependencies_point_down_only(dist_dir: str) -> None:
    module = dist_dir.replace("-", "_")
    deps = [re.split(r"[=<>\[ ]", d)[0] for d in _project(dist_dir)["dependencies"]]  # type: ignore[union-attr]
    for dep in deps:
        dep_module = dep.replace("-", "_")
        if dep_module in LAYER_RANK:
            assert LAYER_RANK[dep_module] < LAYER_RANK[module], f"{dist_dir} depends on {dep}"


def test_sources_keep_their_shape() -> None:
    from source_shape import shape_excesses

    assert shape_excesses(PACKAGES) == []


def test_shape_check_catches_hidden_cycles_and_long_functions(tmp_path: Path) -> None:
    from source_shape import FUNCTION_MAX, shape_excesses

    src = tmp_path / "pkg-a" / "src" / "pkg_a"
    src.mkdir(parents=True)
    (src / "__init__.py").write_text("from pkg_a.one import f\n")
    (src / "one.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg_a.two import g\n"
        "def f() -> None:\n" + "    x = 1\n" * (FUNCTION_MAX + 1)
    )
    (src / "two.py").write_text("def g() -> None:\n    from pkg_a import one\n")
    found = shape_excesses(tmp_path)
    assert any("import cycle: pkg_a.one <-> pkg_a.two" in f for f in found), found
    assert any(f"function f body {FUNCTION_MAX + 1} lines" in f for f in found), found
