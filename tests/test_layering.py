"""Dependencies point down (docs/architecture.md, "Layers").

Read from the source with ``ast`` (nothing is imported).  Every ``import`` counts,
wherever it is: at module level, under ``if TYPE_CHECKING:`` (a type-only circle is still
a circle for the reader) and inside function bodies (a lazy import is where a circle
closes unseen).  ``from pkg import name`` counts ``pkg.name`` when that is a module, else
``pkg``; a parent package's ``__init__`` is not counted for its submodules.

The layers, bottom to top (a module may import its own layer and those below):

====  =============================================================================
0     ``envs``, ``logger``, ``gc_heap``: process settings, no pagedllm imports
1     plain data: ``sampling_params``, ``structured_outputs_params``,
      ``pooling_params``, ``outputs``, ``pooling_outputs``, ``beam_search``,
      ``messages``, ``request``, ``metrics`` (and ``metrics_reader``);
      ``model_files/`` (what a model is on disk); ``lora/`` (adapter requests, files
      and names); ``multimodal/`` (images in: the features a request carries,
      loading, the front end's processor)
2     the torch-free engine side: ``config.py`` (plain dataclasses), ``core/`` (the
      scheduler and KV manager), ``spec_decode/`` and ``structured_output/`` (their
      scheduling policy and grammar compilation)
3     kernels: ``kernels/`` (Triton), ``cpu/`` (C), ``distributed/``
4     ``attention/``
5     ``layers/``, ``sample/``
6     ``models/``
7     ``worker/`` (with the device halves of speculative decoding, structured output
      and LoRA)
8     ``executor/``
9     ``engine/`` (``engine/arg_utils.py`` builds ``EngineConfig`` from ``EngineArgs``)
10    ``entrypoints/``, ``benchmarks/``, ``__main__``, the package's ``__init__``
====  =============================================================================

``ALLOWED_UPWARD`` lists the arrows that still point up, each with its reason; keep it
short (it is empty when the layers are clean).
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "pagedllm"

LAYERS: list[tuple[str, ...]] = [
    ("envs", "logger", "gc_heap"),
    ("sampling_params", "structured_outputs_params", "pooling_params", "outputs",
     "pooling_outputs", "beam_search", "messages", "request", "metrics", "model_files",
     "lora", "multimodal", "metrics_reader"),
    ("config", "core", "spec_decode", "structured_output"),
    ("kernels", "cpu", "distributed"),
    ("attention",),
    ("layers", "sample"),
    ("models",),
    ("worker",),
    ("executor",),
    ("engine",),
    ("entrypoints", "benchmarks", "__main__", ""),  # "": pagedllm/__init__.py
]
RANK = {("pagedllm." + p).rstrip("."): i for i, names in enumerate(LAYERS) for p in names}

# "importer -> imported": why the arrow must point up for now.
ALLOWED_UPWARD: dict[str, str] = {}


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


PATHS = {_module_name(p): p for p in ROOT.rglob("*.py")}


def _imports(name: str, tree: ast.Module) -> set[str]:
    """The pagedllm modules ``name`` imports anywhere in its source."""
    package = name if PATHS[name].name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: from the package, one level up per extra dot
                base = package.split(".")[:len(package.split(".")) - (node.level - 1)]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            for a in node.names:
                sub = f"{module}.{a.name}"
                found.add(sub if sub in PATHS else module)
    return {m for m in found if m in PATHS} - {name}


GRAPH = {name: _imports(name, ast.parse(p.read_text())) for name, p in PATHS.items()}


def _rank(name: str) -> int | None:
    """The layer of module ``name``: its longest dotted prefix named in ``LAYERS``."""
    parts = name.split(".")
    for n in range(len(parts), 1, -1):
        rank = RANK.get(".".join(parts[:n]))
        if rank is not None:
            return rank
    return RANK.get(name)  # only the package itself, "pagedllm"


def test_every_top_level_module_has_a_layer() -> None:
    top = {p.stem if p.is_file() else p.name for p in ROOT.iterdir()
           if (p.suffix == ".py" and p.stem != "__init__")
           or (p.is_dir() and any(p.rglob("*.py")))}
    named = {n.split(".")[0] for names in LAYERS for n in names if n}
    assert top <= named, f"top-level modules without a layer in LAYERS: {sorted(top - named)}"
    assert not [m for m in GRAPH if _rank(m) is None]


def test_no_import_cycles() -> None:
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def strongconnect(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(GRAPH[v]):
            if w not in index:
                strongconnect(w)
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
                cycles.append(sorted(comp))

    for v in sorted(GRAPH):
        if v not in index:
            strongconnect(v)
    assert not cycles, f"modules that import each other: {cycles}"


def test_imports_point_down() -> None:
    up = sorted(f"{m} -> {dep}" for m, deps in GRAPH.items() for dep in deps
                if _rank(dep) > _rank(m))  # type: ignore[operator]
    bad = [a for a in up if a not in ALLOWED_UPWARD]
    assert not bad, f"imports that point up (LAYERS in {__name__}): {bad}"
    stale = sorted(set(ALLOWED_UPWARD) - set(up))
    assert not stale, f"ALLOWED_UPWARD lists arrows that no longer exist: {stale}"
