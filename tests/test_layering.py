"""Package layering: no import cycles among the modules of ``dgr`` and ``meshnet_adapter``, and
``dgr`` never imports ``meshnet_adapter`` (it sits on top of ``dgr``).

The import graph is built statically (``ast``) from the source files, every import statement
counted, including function-local and ``TYPE_CHECKING`` ones: a lazy import still ties two
modules together. ``from PKG import NAME`` counts as an import of the module ``PKG.NAME`` when
that is a module, else of ``PKG``. The generated protobuf code (``dgr.shard``) is a leaf.
"""

from __future__ import annotations

import ast
import functools
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
ROOTS = {"dgr": REPO / "cli" / "dgr", "meshnet_adapter": REPO / "meshnet_adapter"}


def _modules() -> dict[str, Path]:
    out = {}
    for top, base in ROOTS.items():
        for path in base.rglob("*.py"):
            parts = [top, *path.relative_to(base).with_suffix("").parts]
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join(parts)] = path
    return out


def _is_package(mod: str, modules: dict[str, Path]) -> bool:
    return modules[mod].name == "__init__.py"


def _resolve(mod: str, level: int, name: str | None, modules: dict[str, Path]) -> str:
    if not level:
        return name or ""
    base = mod.split(".") if _is_package(mod, modules) else mod.split(".")[:-1]
    if level > 1:
        base = base[: len(base) - (level - 1)]
    return ".".join(base + ([name] if name else []))


def _nearest_module(name: str, modules: dict[str, Path]) -> str | None:
    """``name`` or the closest enclosing module of ours (``dgr.x.CONST`` -> ``dgr.x``)."""
    parts = name.split(".")
    while parts:
        cand = ".".join(parts)
        if cand in modules:
            return cand
        parts.pop()
    return None


@functools.cache
def import_graph() -> dict[str, set[str]]:
    modules = _modules()
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for mod, path in modules.items():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                src = _resolve(mod, node.level, node.module, modules)
                for a in node.names:
                    full = f"{src}.{a.name}"
                    targets.append(full if full in modules else src)
            for t in targets:
                dep = _nearest_module(t, modules)
                if dep is not None and dep != mod:
                    graph[mod].add(dep)
    return graph


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []
    counter = [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_the_graph_sees_the_packages():
    g = import_graph()
    assert "dgr.route.driver" in g and "meshnet_adapter.backend" in g
    assert "dgr.protocol.client" in g["dgr.route.driver"]            # a top-level import
    assert "dgr.route.supervisor" in g["dgr.route.local"]            # a function-local import
    assert "dgr.errors" in g["dgr.route.local"]                      # `from ..errors import DgrError`


def test_no_import_cycles():
    cycles = find_cycles(import_graph())
    assert not cycles, "import cycles: " + "; ".join(" <-> ".join(c) for c in cycles)


def test_dgr_never_imports_meshnet_adapter():
    bad = sorted(f"{m} -> {d}" for m, deps in import_graph().items() if m.split(".")[0] == "dgr"
                 for d in deps if d.split(".")[0] == "meshnet_adapter")
    assert not bad, "dgr imports meshnet_adapter: " + ", ".join(bad)


@pytest.mark.parametrize("graph, cycle", [
    ({"a": {"b"}, "b": {"a"}}, [["a", "b"]]),
    ({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}, [["a", "b", "c"]]),
    ({"a": {"b"}, "b": set(), "c": {"a", "b"}}, []),
])
def test_cycle_finder(graph, cycle):
    assert find_cycles(graph) == cycle
