"""kvgeom_nixl uses only kvgeom's public faces (docs/design.md §2): ``from kvgeom import X`` or
``from kvgeom.<subpackage> import X`` with X in that face's ``__all__``; never a deep module, a
private name, ``import kvgeom...`` or a dynamic import. Read from the source with ``ast`` (every
import, module level or inside a function), so it needs neither torch nor nixl."""

from __future__ import annotations

import ast
import importlib
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
NIXL_DIR = ROOT / "kvgeom_nixl"
FACES = ["kvgeom"] + sorted(f"kvgeom.{d.name}" for d in (ROOT / "kvgeom").iterdir() if (d / "__init__.py").is_file())


def _face_all(face: str) -> set[str]:
    return set(importlib.import_module(face).__all__)


def violations(source: str, filename: str = "<src>") -> list[str]:
    """Every import of kvgeom in ``source`` that is not a public name of a face, as ``file:line: text``."""
    out: list[str] = []
    for node in ast.walk(ast.parse(source, filename)):
        where = f"{filename}:{getattr(node, 'lineno', 0)}"
        if isinstance(node, ast.Import):
            out += [f"{where}: import {a.name}" for a in node.names if a.name.split(".")[0] == "kvgeom"]
        elif isinstance(node, ast.ImportFrom):
            if node.level > 1:
                out.append(f"{where}: relative import above kvgeom_nixl (level {node.level})")
                continue
            mod = node.module or ""
            if node.level or mod.split(".")[0] != "kvgeom":
                continue
            if mod not in FACES:
                out.append(f"{where}: from {mod} import ... (not a face: use kvgeom or kvgeom.<subpackage>)")
                continue
            public = _face_all(mod)
            out += [f"{where}: from {mod} import {a.name} (not in {mod}.__all__)" for a in node.names
                    if a.name not in public]
        elif isinstance(node, ast.Call):
            name = getattr(node.func, "attr", getattr(node.func, "id", ""))
            arg = node.args[0] if node.args else None
            target = arg.value if isinstance(arg, ast.Constant) and isinstance(arg.value, str) else "kvgeom?"
            if name in ("import_module", "__import__") and target.split(".")[0] in ("kvgeom", "kvgeom?"):
                out.append(f"{where}: dynamic import")  # of kvgeom, or of a name not known here
    return out


MODULES = sorted(NIXL_DIR.rglob("*.py"))


def test_every_module_is_checked() -> None:
    names = {p.name for p in MODULES}
    assert {"__init__.py", "endpoint.py", "transfer.py", "agent.py", "receive.py", "handshake.py"} <= names


@pytest.mark.parametrize("path", MODULES, ids=lambda p: p.name)
def test_kvgeom_nixl_imports_only_public_faces(path: pathlib.Path) -> None:
    assert violations(path.read_text(), str(path.relative_to(ROOT))) == []


@pytest.mark.parametrize("bad, why", [
    ("from kvgeom.values.plan import Copies", "not a face"),
    ("from kvgeom.errors import PlanError", "not a face"),
    ("from kvgeom.values import _pages", "not in kvgeom.values.__all__"),
    ("from kvgeom import arith", "not in kvgeom.__all__"),
    ("from kvgeom.lowering import TransferPlan", "not in kvgeom.lowering.__all__"),
    ("import kvgeom.values", "import kvgeom.values"),
    ("import kvgeom", "import kvgeom"),
    ("def f():\n    from kvgeom.arith.runs import run_bases\n", "not a face"),
    ("import importlib\nimportlib.import_module('kvgeom.values.plan')", "dynamic import"),
    ("from ..kvgeom import values", "relative import above"),
    ("__import__(name)", "dynamic import"),
])
def test_the_check_refuses_deep_private_and_dynamic_imports(bad: str, why: str) -> None:
    found = violations(bad)
    assert len(found) == 1 and why in found[0], found


def test_the_check_accepts_public_faces() -> None:
    ok = ("from kvgeom import Copies, plan_pair\nfrom kvgeom.lowering import tile_table\n"
          "from kvgeom.arith import run_bases\nfrom .errors import ExecutorError\nimport numpy as np\n"
          "importlib.import_module('nixl._api')\n")
    assert violations(ok) == []
