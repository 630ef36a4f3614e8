"""The engine's module graph: no import circles, and nothing from the cluster package.

Every import counts, including those under TYPE_CHECKING and inside
functions: a circle there is still two modules that cannot be read apart.
"""

from __future__ import annotations

import ast
from pathlib import Path

ENGINE = Path(__file__).resolve().parents[2] / "pagefleet" / "engine"


def _module_name(path: Path) -> str:
    parts = path.relative_to(ENGINE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph() -> dict[str, set[str]]:
    """engine module -> the engine modules it imports."""
    modules = {_module_name(p): p for p in ENGINE.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
        deps: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                target = ".".join([*base, *([node.module] if node.module else [])])
                candidates = [target] + [f"{target}.{a.name}" for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                candidates = [node.module.removeprefix("pagefleet.")]
            elif isinstance(node, ast.Import):
                candidates = [a.name.removeprefix("pagefleet.") for a in node.names]
            else:
                continue
            deps |= {c for c in candidates if c in modules and c != name}
        graph[name] = deps
    # The top package's __init__ re-exports everything; `from .x import y` passes
    # through it only to reach x.
    return {m: ds - {"engine"} for m, ds in graph.items()}


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    cycles: list[list[str]] = []
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> None:
        state[node] = 1
        path.append(node)
        for dep in sorted(graph.get(node, ())):
            if state.get(dep) == 1:
                cycles.append([*path[path.index(dep) :], dep])
            elif dep not in state:
                visit(dep)
        path.pop()
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node)
    return cycles


def test_engine_has_no_import_cycles() -> None:
    graph = import_graph()
    assert "engine.llm_engine" in graph and "engine.token_engine" in graph["engine.llm_engine"]
    assert find_cycles(graph) == []


def test_cycle_finder_finds_a_cycle() -> None:
    assert find_cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c", "a"]]


def test_engine_imports_nothing_from_cluster() -> None:
    for path in ENGINE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module:
                assert "cluster" not in node.module.split("."), f"{path}: {node.module}"
