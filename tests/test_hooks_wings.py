"""Layer 3's wings: each subpackage of ``mfsdp_hooks`` imports only wings ranked below it,
and code outside layer 3 reaches the engine through ``mfsdp_hooks``'s public names (the
``testing`` wing excepted: it is what the layers above test with)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
HOOKS = ROOT / "packages" / "mfsdp-hooks" / "src" / "mfsdp_hooks"
# Bottom first: a wing may import only wings of a strictly lower rank.
WING_RANK = {
    "config": 1,
    "dtensor": 2,
    "grads": 3,
    "weights": 4,
    "runtime": 5,
    "optim": 6,
    "api": 7,
    "testing": 8,
}
# The package's __init__ is the public face and sees every wing.
PUBLIC_FACE = 9


def _hooks_imports(path: Path) -> list[tuple[int, list[str]]]:
    """(line, dotted path split) of every absolute ``mfsdp_hooks`` import in ``path``."""
    found: list[tuple[int, list[str]]] = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        found += [(node.lineno, n.split(".")) for n in names if n.split(".")[0] == "mfsdp_hooks"]
    return found


def wing_violations(hooks_dir: Path) -> list[str]:
    """Every import inside the package that points to a wing at or above its own, a module
    outside any wing, or a wing nobody ranked."""
    bad = []
    for path in sorted(hooks_dir.rglob("*.py")):
        parts = path.relative_to(hooks_dir).parts
        if len(parts) == 1:
            if parts[0] != "__init__.py":
                bad.append(f"{parts[0]}: a module outside the wings")
            rank = PUBLIC_FACE
        elif parts[0] not in WING_RANK:
            bad.append(f"{parts[0]}: a wing without a rank")
            continue
        else:
            rank = WING_RANK[parts[0]]
        for lineno, dotted in _hooks_imports(path):
            target = dotted[1] if len(dotted) > 1 else None
            same = len(parts) > 1 and target == parts[0]
            if target is None or (not same and WING_RANK.get(target, PUBLIC_FACE) >= rank):
                bad.append(f"{'/'.join(parts)}:{lineno}: -> {'.'.join(dotted)}")
    return bad


def deep_imports_from_outside(root: Path) -> list[str]:
    """Imports of an engine submodule by path from outside layer 3 (tests of layer 3 may)."""
    bad = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        if rel.parts[0].startswith(".") or rel.parts[:2] == ("packages", "mfsdp-hooks"):
            continue
        for lineno, dotted in _hooks_imports(path):
            if len(dotted) > 1 and dotted[1] != "testing":
                bad.append(f"{rel}:{lineno}: {'.'.join(dotted)}")
    return bad


def test_wings_import_only_wings_below() -> None:
    assert wing_violations(HOOKS) == []


def test_outside_layer_3_imports_only_public_names() -> None:
    assert deep_imports_from_outside(ROOT) == []


def test_wing_check_catches_an_upward_import_and_a_stray_module(tmp_path: Path) -> None:
    (tmp_path / "grads").mkdir()
    (tmp_path / "grads" / "reducer.py").write_text(
        "from mfsdp_hooks.config.strategy import ShardingStrategy\n"
        "from mfsdp_hooks.grads.shard import GradShard\n"
        "from mfsdp_hooks.runtime.unit import FSDPUnit\n"
        "import mfsdp_hooks\n"
    )
    (tmp_path / "stray.py").write_text("x = 1\n")
    assert wing_violations(tmp_path) == [
        "grads/reducer.py:3: -> mfsdp_hooks.runtime.unit",
        "grads/reducer.py:4: -> mfsdp_hooks",
        "stray.py: a module outside the wings",
    ]
