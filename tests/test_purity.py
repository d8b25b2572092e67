"""Importing kvgeom (and running its pure commands) never imports torch, nixl, matplotlib or hypothesis.

Each check runs in a fresh interpreter, because this test process may already hold those modules.
Modules that exist to use an optional extra are listed in ``OPTIONAL`` and left out of the sweep.
"""

from __future__ import annotations

import importlib.util
import json
import pkgutil
import subprocess
import sys
import textwrap

import pytest

import kvgeom

HEAVY = ("torch", "nixl", "matplotlib", "hypothesis")
OPTIONAL = {
    "kvgeom.tools.strategies": "hypothesis strategies (the testing extra)",
    "kvgeom.tools.engine_strategies": "hypothesis strategies (the testing extra)",
    "kvgeom.tools.pair_strategies": "hypothesis strategies (the testing extra)",
    "kvgeom.tools.request_strategies": "hypothesis strategies (the testing extra)",
    "kvgeom.tools.fuzz": "the fuzz command, built on hypothesis",
    "kvgeom.__main__": "runs the command line when imported",
}


def _heavy_after(code: str) -> list[str]:
    probe = textwrap.dedent(code) + textwrap.dedent(f"""
        import json, sys
        print(json.dumps(sorted(m for m in {HEAVY!r} if m in sys.modules)))
    """)
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return list(json.loads(done.stdout.strip().splitlines()[-1]))


def _pure_modules() -> list[str]:
    names = [m.name for m in pkgutil.walk_packages(kvgeom.__path__, "kvgeom.")]
    return sorted(n for n in names if n not in OPTIONAL)


def test_import_kvgeom_is_pure() -> None:
    assert _heavy_after("import kvgeom") == []


def test_every_pure_module_is_pure() -> None:
    modules = _pure_modules()
    assert {"kvgeom.tools.cli", "kvgeom.building.presets", "kvgeom.values.text", "kvgeom.values.engine",
            "kvgeom.values.plan", "kvgeom.show.drawing"} <= set(modules)
    assert _heavy_after("\n".join(f"import {m}" for m in modules)) == []


def test_the_heavy_modules_are_detectable() -> None:
    """The probe itself can fail: importing a heavy module that is installed shows up."""
    present = [m for m in HEAVY if importlib.util.find_spec(m) is not None]
    if not present:
        pytest.skip("none of torch, nixl, matplotlib, hypothesis is installed")
    assert _heavy_after(f"import {present[0]}") == [present[0]]


@pytest.mark.parametrize("argv", [["presets"], ["plan", "--json"], ["plan", "--preset", "unpairable-fp8"],
                                  ["--help"]])
def test_cli_commands_stay_pure(argv: list[str]) -> None:
    code = f"""
        import contextlib, io
        from kvgeom.tools.cli import main
        with contextlib.redirect_stdout(io.StringIO()):
            main({argv!r})
    """
    assert _heavy_after(code) == []
