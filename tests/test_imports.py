"""No import circle in edgemem: every import statement of every module (at module level or inside a
function, relative ones resolved) is an edge, and no module reaches itself.

`from package import name` is an edge to `package.name` when that is a module, else to `package`.
Importing a module is not counted as importing its parent packages (Python has them loaded, or
loading, by then; counting them would make a circle of every package that re-exports its modules).
Imports under `if TYPE_CHECKING:` never run and are not edges; nor is an import by name
(`importlib.import_module`, as `Engine.load` finds its backend and `onnx_functions` an op's onnx.py).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# circle (its modules) → why it stays; none so far
ALLOWED: dict[frozenset[str], str] = {}


def modules(root: Path, package: str) -> dict[str, Path]:
    """Module name → file of every module of `package` (a folder under `root`)."""
    found = {}
    for path in sorted((root / package).rglob("*.py")):
        parts = path.relative_to(root).with_suffix("").parts
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def _is_type_checking(node: ast.AST) -> bool:
    test = node.test if isinstance(node, ast.If) else None
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(nodes):
    """Every Import / ImportFrom among `nodes` and inside them, skipping `if TYPE_CHECKING:` bodies."""
    for node in nodes:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        elif _is_type_checking(node):
            yield from _imports(node.orelse)
        else:
            yield from _imports(ast.iter_child_nodes(node))


def edges(known: dict[str, Path]) -> dict[str, dict[str, int]]:
    """Module → {imported module of `known`: line of the first such import}."""
    graph = {}
    for name, path in known.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        targets: dict[str, int] = {}
        for node in _imports([ast.parse(path.read_text(encoding="utf-8"), str(path))]):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            else:
                base = node.module or ""
                if node.level:
                    anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(anchor + ([base] if base else []))
                names = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
            for target in names:
                if target in known and target != name:
                    targets.setdefault(target, node.lineno)
        graph[name] = targets
    return graph


def circles(graph: dict[str, dict[str, int]]) -> list[frozenset[str]]:
    """The strongly connected components with more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while not component or component[-1] != v:
                component.append(stack.pop())
            if len(component) > 1:
                found.append(frozenset(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def describe(graph: dict[str, dict[str, int]], known: dict[str, Path], circle: frozenset[str]) -> str:
    lines = [
        f"  {a} → {b} ({known[a].relative_to(ROOT)}:{line})"
        for a in sorted(circle)
        for b, line in sorted(graph[a].items())
        if b in circle
    ]
    return "\n".join(lines)


def test_edgemem_has_no_import_circle():
    known = modules(ROOT, "edgemem")
    graph = edges(known)
    new = [c for c in circles(graph) if c not in ALLOWED]
    assert not new, "import circles:\n" + "\n\n".join(describe(graph, known, c) for c in new)


def test_walker_sees_relative_and_function_level_imports(tmp_path):
    """A package whose circle runs through a relative import and an import inside a function, beside
    a TYPE_CHECKING import and a `from package import module` that close no circle."""
    files = {
        "pkg/__init__.py": "from pkg.a import f\n",
        "pkg/a.py": "from .sub import b\n\ndef f():\n    from pkg.c import g\n",
        "pkg/sub/__init__.py": "",
        "pkg/sub/b.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.a import f\n",
        "pkg/c.py": "from . import a\n",
    }
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    known = modules(tmp_path, "pkg")
    graph = edges(known)
    assert graph == {
        "pkg": {"pkg.a": 1},
        "pkg.a": {"pkg.sub.b": 1, "pkg.c": 4},
        "pkg.sub": {},
        "pkg.sub.b": {},
        "pkg.c": {"pkg.a": 1},
    }
    assert circles(graph) == [frozenset({"pkg.a", "pkg.c"})]


@pytest.mark.parametrize("level,expected", [(1, "pkg.sub.x"), (2, "pkg.x")])
def test_relative_imports_resolve_from_the_modules_package(tmp_path, level, expected):
    for name in ("pkg/__init__.py", "pkg/x.py", "pkg/sub/__init__.py", "pkg/sub/x.py"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text("")
    (tmp_path / "pkg/sub/y.py").write_text(f"from {'.' * level} import x\n")
    assert edges(modules(tmp_path, "pkg"))["pkg.sub.y"] == {expected: 1}
