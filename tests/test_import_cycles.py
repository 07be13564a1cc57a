"""No two modules of epikv import each other (the layering rule of the developers' guide): every import is read
from the source (AST), function-level ones included, so a circle cannot hide behind a lazy import."""

import ast
from pathlib import Path

PKG = Path(__file__).resolve().parents[1] / "src" / "epikv"

def _modules() -> dict[str, tuple[Path, bool]]:
    mods = {}
    for path in PKG.rglob("*.py"):
        parts = list(path.relative_to(PKG.parent).with_suffix("").parts)
        is_pkg = parts[-1] == "__init__"
        mods[".".join(parts[:-1] if is_pkg else parts)] = (path, is_pkg)
    return mods


def import_graph() -> dict[str, set[str]]:
    """Module -> the epikv modules it imports anywhere in its source (`from . import x` counts as importing x)."""
    mods = _modules()
    graph = {}
    for name, (path, is_pkg) in mods.items():
        here = name.split(".") if is_pkg else name.split(".")[:-1]
        deps = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                deps.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = here[: len(here) - node.level + 1] if node.level else []
                mod = ".".join(base + ([node.module] if node.module else []))
                for a in node.names:
                    sub = f"{mod}.{a.name}"
                    deps.add(sub if sub in mods else mod)
        graph[name] = {d for d in deps if d in mods and d != name}
    return graph


def two_module_cycles(graph: dict[str, set[str]]) -> set[tuple[str, str]]:
    return {(a, b) for a, deps in graph.items() for b in deps if a < b and a in graph.get(b, ())}


def test_graph_sees_function_level_and_relative_imports():
    g = import_graph()
    # a function-level import (checks.check_internals imports the layouts inside its body) and a relative one
    assert "epikv.serving.layout" in g["epikv.serving.checks"]
    assert "epikv.policies.pages" in g["epikv.policies.base"]


def test_no_two_module_import_cycle():
    cycles = two_module_cycles(import_graph())
    assert not cycles, "modules importing each other: " + ", ".join(f"{a} <-> {b}" for a, b in sorted(cycles))
