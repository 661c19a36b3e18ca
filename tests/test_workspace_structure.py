"""Workspace invariants: exact pins in the meta-package, imports that only point down,
versions above NVIDIA's same-named project, and user docs whose install lines install ours."""

from __future__ import annotations

import ast
import re
import shlex
import sys
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.version import Version

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ROOT / "packages"
# NVIDIA's megatron-fsdp on PyPI (same distribution and import name as ours): its newest
# release when this was written. Ours must version above it, so that no resolver prefers it.
NVIDIA_NEWEST = Version("0.6.1")
# Layers bottom first, as the install line from a clone names them.
LAYERS = [
    "mfsdp-buffers",
    "mfsdp-collectives",
    "mfsdp-hooks",
    "mfsdp-checkpoint",
    "mfsdp-te",
    "megatron-fsdp",
]
USER_DOCS = [
    ROOT / "README.md",
    *sorted(PACKAGES.glob("*/README.md")),
    *sorted((ROOT / "docs").glob("**/*.md")),
]
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
    hooks.write_text(hooks.read_text().replace('version = "1.0.0"', 'version = "1.0.1"', 1))
    assert pin_mismatches(copy) == ["mfsdp-hooks: pinned '==1.0.0' but the package is 1.0.1"]


def test_versions_are_above_every_nvidia_release_and_agree_with_the_sources() -> None:
    """NVIDIA publishes `megatron-fsdp` 0.1.0 ... 0.6.1 on PyPI: at 0.1.0 ours lost to theirs
    in any resolver that saw both. Each `__version__` is the package's version."""
    root = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    assert Version(root) > NVIDIA_NEWEST, root
    for dist_dir in LAYERS:
        declared = str(_project(dist_dir)["version"])
        assert Version(declared) > NVIDIA_NEWEST, (dist_dir, declared)
        init = PACKAGES / dist_dir / "src" / dist_dir.replace("-", "_") / "__init__.py"
        found = re.findall(r'^__version__ = "([^"]+)"$', init.read_text(), flags=re.M)
        assert found == [declared], (dist_dir, found, declared)


def test_each_layer_admits_the_current_versions_of_the_layers_below() -> None:
    versions = {d: Version(str(_project(d)["version"])) for d in LAYERS}
    for dist_dir in LAYERS:
        dependencies = _project(dist_dir)["dependencies"]
        assert isinstance(dependencies, list)
        for text in dependencies:
            requirement = Requirement(text)
            if requirement.name in versions:
                assert requirement.specifier.contains(versions[requirement.name]), (
                    dist_dir,
                    text,
                )


_OPTIONS_WITH_A_VALUE = {
    "-f",
    "--find-links",
    "-i",
    "--index-url",
    "--extra-index-url",
    "-r",
    "--requirement",
    "-c",
    "--constraint",
    "--python",
    "-t",
    "--target",
}


def pip_install_commands(text: str) -> list[list[str]]:
    """The arguments of every `pip install` command in a markdown text (in code blocks or
    inline code; `&&`-chained commands and trailing comments cut off)."""
    commands = []
    for match in re.finditer(r"pip install ([^`\n]*)", text):
        command = re.split(r"&&|;|\s#", match.group(1))[0]
        commands.append(shlex.split(command))
    return commands


def foreign_installs(args: list[str]) -> list[str]:
    """Requirements of one `pip install` that name one of our distributions and could be
    served by an index, where a same-named project of someone else may stand in (NVIDIA's
    `megatron-fsdp` does). Paths are ours; `--no-index` keeps indexes out."""
    if "--no-index" in args:
        return []
    found, skip = [], False
    for arg in args:
        if skip or arg.startswith("-"):
            skip = arg in _OPTIONS_WITH_A_VALUE
            continue
        if arg.startswith((".", "/")):
            continue
        name = re.match(r"[A-Za-z0-9._-]+", arg)
        if name and name.group(0).lower().replace("_", "-") in LAYERS:
            found.append(arg)
    return found


@pytest.mark.parametrize("doc", USER_DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_install_line_in_the_docs_installs_ours(doc: Path) -> None:
    bad = [
        " ".join(args) for args in pip_install_commands(doc.read_text()) if foreign_installs(args)
    ]
    assert bad == [], f"{doc.relative_to(ROOT)}: these would install from an index: {bad}"


def test_install_check_catches_an_install_from_pypi() -> None:
    text = '```bash\npip install megatron-fsdp   # the stack\n```\n`pip install "mfsdp-te[te]"`'
    assert [foreign_installs(a) for a in pip_install_commands(text)] == [
        ["megatron-fsdp"],
        ["mfsdp-te[te]"],
    ]
    fine = "`pip install --no-index --find-links dist megatron-fsdp` `pip install ./packages/x`"
    assert [foreign_installs(a) for a in pip_install_commands(fine)] == [[], []]


def _readme_block(name: str) -> list[list[str]]:
    text = (ROOT / "README.md").read_text()
    begin, end = f"<!-- {name}:begin -->", f"<!-- {name}:end -->"
    assert begin in text and end in text, f"README.md lost its {name} markers (nox -s build)"
    return pip_install_commands(text.split(begin, 1)[1].split(end, 1)[0])


def test_readme_installs_every_package_from_a_clone_in_one_command() -> None:
    """One pip command, so pip resolves the `==` pins among the six local packages; the
    line `nox -s build` runs as written."""
    assert _readme_block("install-from-clone") == [[f"./packages/{d}" for d in LAYERS]]
    assert sorted(p.name for p in PACKAGES.iterdir() if (p / "pyproject.toml").exists()) == sorted(
        LAYERS
    )


def test_readme_installs_from_wheels_without_an_index() -> None:
    commands = _readme_block("install-from-wheels")
    assert commands[-1] == ["--no-index", "--find-links", "dist", "megatron-fsdp"]
    assert [foreign_installs(args) for args in commands] == [[] for _ in commands]


@pytest.mark.parametrize("doc", USER_DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_user_docs_speak_to_users(doc: Path) -> None:
    """No build-history labels, no machine a reader never saw, no file outside a clone, and
    every relative link resolves."""
    text = doc.read_text()
    for pattern in (r"(?i)\bsessions? \d", r"(?i)\bthis box\b", r"\.\./shared/"):
        assert not re.search(pattern, text), (doc.relative_to(ROOT), pattern)
    for target in re.findall(r"\]\(([^)#\s]+)", text):
        if not re.match(r"[a-z]+:", target):
            assert (doc.parent / target).exists(), (doc.relative_to(ROOT), target)


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
