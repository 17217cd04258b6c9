"""The package's import structure: no module imports one that imports it back, not even for type
checking, and the same holds one level up, with each top-level module or package of kvcore taken
as a whole (so no package reaches back up into one that builds on it).  Read from the source
(every ``import``, TYPE_CHECKING blocks included); lazy imports by string are not edges."""

from __future__ import annotations

import ast
from pathlib import Path

import kvcore

ROOT = Path(kvcore.__file__).parent


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path: Path, modules: set[str]) -> set[str]:
    """The kvcore modules ``path`` imports (``from kvcore import manager`` is kvcore.manager)."""
    out: set[str] = set()
    here = module_name(path)
    package = here if path.name == "__init__.py" else here.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name.startswith("kvcore"))
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[:len(package.split(".")) - node.level + 1]
                                + ([base] if base else []))
            if not base.startswith("kvcore"):
                continue
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                out.add(sub if sub in modules else base)
    return {m for m in out if m in modules and m != here}


def graph() -> dict[str, set[str]]:
    paths = {module_name(p): p for p in ROOT.rglob("*.py")}
    modules = set(paths)
    return {name: imports_of(path, modules) for name, path in paths.items()}


def unit(module: str) -> str:
    """The top-level module or package of kvcore that holds ``module``."""
    parts = module.split(".")
    return ".".join(parts[:2])


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one node (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(edges.get(v, ())):
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
                found.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found


def test_the_reader_sees_the_imports() -> None:
    g = graph()
    assert "kvcore.block_pool" in g["kvcore.manager"]
    assert "kvcore.managers.base" in g["kvcore.coordinator.base"]
    assert "kvcore.types" in g["kvcore.block_pool"]


def test_no_module_imports_one_that_imports_it_back() -> None:
    assert cycles(graph()) == []


def test_no_package_reaches_back_into_one_that_builds_on_it() -> None:
    units: dict[str, set[str]] = {}
    for module, deps in graph().items():
        if module == "kvcore":
            continue  # the package face imports what it exports; nothing imports it
        units.setdefault(unit(module), set()).update(
            unit(d) for d in deps if unit(d) != unit(module) and d != "kvcore")
    assert cycles(units) == []


def test_a_cycle_is_found() -> None:
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
