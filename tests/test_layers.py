"""The import graph runs one way: the tree is the architecture diagram (docs/design.md §2).

Every import in kvgeom/ and kvgeom_nixl/ is read from the source with ``ast`` (module level,
function level and ``TYPE_CHECKING`` blocks alike) and checked against the layer order::

    errors < arith < values < {planning, lowering, checking} < {building, show, conformance} < tools
           < kvgeom (the root face, __main__) < kvgeom_nixl

A module may import modules of its own unit (no cycles) and of lower layers only; siblings on one
layer never import each other; nothing calls ``importlib.import_module`` or ``__import__``.
"""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

LAYERS: dict[str, int] = {
    "kvgeom.errors": 0,
    "kvgeom.arith": 1,
    "kvgeom.values": 2,
    "kvgeom.planning": 3,
    "kvgeom.lowering": 3,
    "kvgeom.checking": 3,
    "kvgeom.building": 4,
    "kvgeom.show": 4,
    "kvgeom.conformance": 4,
    "kvgeom.tools": 5,
    "kvgeom": 6,
    "kvgeom_nixl": 7,
}


def _modules() -> dict[str, Path]:
    out = {}
    for pkg in ("kvgeom", "kvgeom_nixl"):
        for f in (ROOT / pkg).rglob("*.py"):
            parts = f.relative_to(ROOT).with_suffix("").parts
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            out[name] = f
    return out


MODULES = _modules()


def unit(module: str) -> str:
    """The layer unit a module belongs to: its subpackage, or the root face for kvgeom/__init__ and
    kvgeom/__main__."""
    parts = module.split(".")
    if parts[0] == "kvgeom_nixl":
        return "kvgeom_nixl"
    if len(parts) >= 2 and f"kvgeom.{parts[1]}" in LAYERS:
        return f"kvgeom.{parts[1]}"
    return "kvgeom"


def _resolve(module: str, node: ast.ImportFrom | ast.Import) -> list[str]:
    """Project modules an import statement names (``from .x import y`` may name module x.y)."""
    if isinstance(node, ast.Import):
        names = [a.name for a in node.names]
    else:
        base = module.split(".")
        if MODULES[module].name != "__init__.py":
            base = base[:-1]
        if node.level:
            base = base[: len(base) - (node.level - 1)]
            target = ".".join(base + ([node.module] if node.module else []))
        else:
            target = node.module or ""
        names = [target] + [f"{target}.{a.name}" for a in node.names]
    out = []
    for t in names:
        while t and t not in MODULES:
            t = t.rpartition(".")[0]
        if t and t != module:
            out.append(t)
    return out


def _graph() -> tuple[dict[str, set[str]], list[str]]:
    edges: dict[str, set[str]] = defaultdict(set)
    dynamic = []
    for m, f in MODULES.items():
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                for t in _resolve(m, node):
                    # a submodule naming its own package face (``from . import x``) imports x, not the face
                    if MODULES[t].name == "__init__.py" and m.startswith(t + "."):
                        continue
                    edges[m].add(t)
            if isinstance(node, ast.Call):
                name = getattr(node.func, "attr", getattr(node.func, "id", ""))
                if name in ("import_module", "__import__"):
                    dynamic.append(f"{m}:{node.lineno}")
    return edges, dynamic


EDGES, DYNAMIC = _graph()


def test_every_module_has_a_layer() -> None:
    assert len(MODULES) > 40
    for m in MODULES:
        assert unit(m) in LAYERS, m
    on_disk = {f"kvgeom.{p.name}" for p in (ROOT / "kvgeom").iterdir() if (p / "__init__.py").exists()}
    assert on_disk | {"kvgeom", "kvgeom.errors", "kvgeom_nixl"} == set(LAYERS), "a subpackage without a layer"


@pytest.mark.parametrize("module", sorted(MODULES))
def test_imports_go_down(module: str) -> None:
    here = unit(module)
    for target in EDGES[module]:
        there = unit(target)
        if there == here:
            continue
        assert LAYERS[there] < LAYERS[here], (
            f"{module} (layer {here}, {LAYERS[here]}) imports {target} (layer {there}, {LAYERS[there]}): "
            "imports must go to lower layers only")


def test_no_cycles() -> None:
    state: dict[str, int] = {}
    path: list[str] = []

    def visit(m: str) -> None:
        state[m] = 1
        path.append(m)
        for t in sorted(EDGES[m]):
            if state.get(t) == 1:
                raise AssertionError("import cycle: " + " -> ".join(path[path.index(t):] + [t]))
            if t not in state:
                visit(t)
        path.pop()
        state[m] = 2

    for m in sorted(MODULES):
        if m not in state:
            visit(m)


def test_no_dynamic_imports() -> None:
    assert DYNAMIC == []


def test_the_simulator_never_imports_the_planner() -> None:
    """The oracle is written from the model, not from the code it checks."""
    for m, targets in EDGES.items():
        if unit(m) == "kvgeom.checking":
            assert not any(unit(t) == "kvgeom.planning" for t in targets), m


def test_the_check_can_fail() -> None:
    """The resolver sees a relative import that climbs a layer (the test is not vacuous)."""
    node = ast.parse("from ..planning.transfer import Pair").body[0]
    assert isinstance(node, ast.ImportFrom)
    assert set(_resolve("kvgeom.checking.simulator", node)) == {"kvgeom.planning.transfer"}
    assert LAYERS[unit("kvgeom.planning.transfer")] == LAYERS[unit("kvgeom.checking.simulator")]
