"""The wing check both layered packages use: each subpackage ("wing") of a package imports
only wings ranked below it (or itself); the package's ``__init__`` is the one module outside
the wings. Relative imports are resolved, so a package that imports itself relatively is
checked as well as one that imports itself by name."""

from __future__ import annotations

import ast
from pathlib import Path


def package_imports(
    path: Path, package: str, ranks: dict[str, int], parts: tuple[str, ...] = ()
) -> list[tuple[int, list[str]]]:
    """(line, dotted path split) of every import of ``package`` in ``path``: at ``parts``
    under the package, relative imports resolved from there; without ``parts`` (a file
    outside the package) absolute imports only."""
    here = [package, *parts[:-1]]  # the package ``path`` is in (``__init__`` included)
    found: list[tuple[int, list[str]]] = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if not isinstance(node, (ast.Import, ast.ImportFrom)):
            continue
        names: list[list[str]] = []
        if isinstance(node, ast.Import):
            names = [alias.name.split(".") for alias in node.names]
        elif node.level == 0 and node.module:
            names = [node.module.split(".")]
        elif not parts:
            continue
        else:
            base = here[: len(here) - node.level + 1]
            if node.module:
                names = [base + node.module.split(".")]
            elif len(base) > 1:  # ``from . import x`` inside a wing: that wing
                names = [base]
            else:  # ``from .. import x`` up to the package: x may be a wing or a public name
                names = [[package, alias.name] for alias in node.names]
                names = [n if n[1] in ranks else [package] for n in names]
        found += [(node.lineno, n) for n in names if n[0] == package]
    return found


def wing_violations(package_dir: Path, package: str, ranks: dict[str, int]) -> list[str]:
    """Every import inside ``package`` (at ``package_dir``) that points to a wing of
    ``ranks`` at or above its own, a module outside any wing, or a wing nobody ranked. The
    package's ``__init__`` is its public face and sees every wing."""
    public_face = max(ranks.values()) + 1
    bad = []
    for path in sorted(package_dir.rglob("*.py")):
        parts = path.relative_to(package_dir).parts
        if len(parts) == 1:
            if parts[0] != "__init__.py":
                bad.append(f"{parts[0]}: a module outside the wings")
            rank = public_face
        elif parts[0] not in ranks:
            bad.append(f"{parts[0]}: a wing without a rank")
            continue
        else:
            rank = ranks[parts[0]]
        for lineno, dotted in package_imports(path, package, ranks, parts):
            target = dotted[1] if len(dotted) > 1 else None
            same = len(parts) > 1 and target == parts[0]
            if target is None or (not same and ranks.get(target, public_face) >= rank):
                bad.append(f"{'/'.join(parts)}:{lineno}: -> {'.'.join(dotted)}")
    return bad
