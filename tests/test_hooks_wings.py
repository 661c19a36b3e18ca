"""Layer 3's wings: each subpackage of ``mfsdp_hooks`` imports only wings ranked below it,
and code outside layer 3 reaches the engine through ``mfsdp_hooks``'s public names (the
``testing`` wing excepted: it is what the layers above test with)."""

from __future__ import annotations

from pathlib import Path

from wings import package_imports
from wings import wing_violations as package_wing_violations

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


def _hooks_imports(path: Path) -> list[tuple[int, list[str]]]:
    """(line, dotted path split) of every ``mfsdp_hooks`` import in ``path``."""
    return package_imports(path, "mfsdp_hooks", WING_RANK)


def wing_violations(hooks_dir: Path) -> list[str]:
    return package_wing_violations(hooks_dir, "mfsdp_hooks", WING_RANK)


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
