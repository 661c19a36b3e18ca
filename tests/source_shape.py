"""The shape rules of our sources: file, function-body and class sizes, and import cycles.

A file over ``FILE_MAX`` lines, a function body over ``FUNCTION_MAX`` or a class over
``CLASS_MAX`` usually hides two concepts; an import cycle inside a package (also one hidden
under ``TYPE_CHECKING`` or inside a function) means two modules own one. A package's
``__init__`` only re-exports, so its imports make no cycle of their own.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

FILE_MAX, FUNCTION_MAX, CLASS_MAX = 450, 60, 250


def _module_names(src: Path) -> dict[str, Path]:
    """``{"pkg.mod": path}`` for every module of the package directory ``src``."""
    found = {}
    for path in sorted(src.rglob("*.py")):
        parts = path.relative_to(src.parent).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found[".".join(parts)] = path
    return found


def _imports(path: Path, name: str, known: set[str]) -> set[str]:
    """The package's modules ``path`` imports anywhere in its text (any nesting)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            for alias in node.names:
                candidate = f"{base}.{alias.name}"
                found.add(candidate if candidate in known else base)
    return {m for m in found if m in known and m != name}


def _strongly_connected(graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's components with more than one module: the import cycles."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return cycles


def _size_excesses(path: Path) -> Iterator[str]:
    text = path.read_text()
    lines = len(text.splitlines())
    if lines > FILE_MAX:
        yield f"{path}: {lines} lines (> {FILE_MAX})"
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body
            docstring = isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant)
            if docstring and len(body) > 1:
                body = body[1:]  # the signature and the docstring are not the body
            size = (node.end_lineno or node.lineno) - body[0].lineno + 1
            if size > FUNCTION_MAX:
                yield f"{path}:{node.lineno}: function {node.name} body {size} lines"
        elif isinstance(node, ast.ClassDef):
            size = (node.end_lineno or node.lineno) - node.lineno + 1
            if size > CLASS_MAX:
                yield f"{path}:{node.lineno}: class {node.name} {size} lines"


def shape_excesses(packages_dir: Path) -> list[str]:
    """Every size excess and import cycle under ``packages_dir/*/src/<package>``."""
    found: list[str] = []
    for src in sorted(packages_dir.glob("*/src/*")):
        if not src.is_dir() or src.name.endswith(".egg-info"):
            continue
        modules = _module_names(src)
        graph: dict[str, set[str]] = {}
        for name, path in modules.items():
            found.extend(_size_excesses(path))
            is_init = path.name == "__init__.py"
            graph[name] = set() if is_init else _imports(path, name, set(modules))
        found.extend(f"import cycle: {' <-> '.join(c)}" for c in _strongly_connected(graph))
    return found
