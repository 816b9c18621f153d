"""Dependencies point down (docs/architecture.md, "Layers").

Read from the source with ``ast`` (nothing is imported): every ``import`` outside a
function body counts, ``if TYPE_CHECKING:`` blocks included, because a type-only circle is
still a circle for the reader.  Imports inside functions are the deliberate lazy ones
(optional backends, the CLI's fast start) and are not counted.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "pagedllm"

# Plain data and the torch-free bookkeeping core: below the engine, the worker and the
# entrypoints.
LOWER = ("pagedllm.messages", "pagedllm.request", "pagedllm.metrics",
         "pagedllm.sampling_params", "pagedllm.outputs", "pagedllm.core")
UPPER = ("pagedllm.engine", "pagedllm.worker", "pagedllm.entrypoints")


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _top_level_imports(tree: ast.Module) -> set[str]:
    found: set[str] = set()

    def visit(body: list[ast.stmt]) -> None:
        for node in body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            if isinstance(node, ast.Import):
                found.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                found.add(node.module)
                found.update(f"{node.module}.{a.name}" for a in node.names)
            for field in ("body", "orelse", "handlers", "finalbody"):
                visit(getattr(node, field, []) or [])

    visit(tree.body)
    return found


def _graph() -> dict[str, set[str]]:
    paths = {_module_name(p): p for p in ROOT.rglob("*.py")}
    return {name: {m for m in _top_level_imports(ast.parse(p.read_text())) if m in paths}
            - {name} for name, p in paths.items()}


def _within(name: str, prefixes: tuple[str, ...]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


GRAPH = _graph()


def test_no_import_cycles() -> None:
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles: list[list[str]] = []

    def strongconnect(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in GRAPH[v]:
            if w not in index:
                strongconnect(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                cycles.append(sorted(comp))

    for v in sorted(GRAPH):
        if v not in index:
            strongconnect(v)
    assert not cycles, f"modules that import each other: {cycles}"


@pytest.mark.parametrize(("lower", "upper"), [
    (LOWER, UPPER),
    (("pagedllm.attention",), ("pagedllm.layers", "pagedllm.models")),
])
def test_lower_layers_do_not_import_upper(lower: tuple[str, ...],
                                          upper: tuple[str, ...]) -> None:
    bad = sorted(f"{m} -> {dep}" for m, deps in GRAPH.items() if _within(m, lower)
                 for dep in deps if _within(dep, upper))
    assert not bad, f"imports that point up: {bad}"
