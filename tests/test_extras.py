"""A missing optional dependency is a typed error naming the pip command (issue 20, item 8).

Each check runs in a fresh interpreter where the module is made unimportable
(``sys.modules[name] = None``), because this test process may already hold it."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _without(blocked: str, code: str) -> dict[str, str]:
    probe = textwrap.dedent(f"""
        import json, sys
        for name in {blocked.split(",")!r}:
            sys.modules[name] = None  # as if it were not installed
        try:
    """) + textwrap.indent(textwrap.dedent(code), "    ") + textwrap.dedent("""
        except ImportError as e:
            from kvgeom import MissingExtra
            print(json.dumps({"type": type(e).__name__, "typed": isinstance(e, MissingExtra),
                              "value_error": isinstance(e, ValueError), "path": getattr(e, "path", None),
                              "fix": getattr(e, "fix", None), "text": str(e)}))
        else:
            print(json.dumps({"type": None}))
    """)
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    return dict(json.loads(done.stdout.strip().splitlines()[-1]))


def test_import_kvgeom_nixl_without_torch_names_the_extra() -> None:
    pytest.importorskip("torch", reason="the control imports kvgeom_nixl with torch")
    got = _without("torch", "import kvgeom_nixl")
    assert got["typed"] and got["value_error"] and got["path"] == "torch"
    assert "[nixl]" in got["fix"] and "pip install" in got["fix"]
    assert _without("no-such-module", "import kvgeom_nixl")["type"] is None  # the control: with torch it imports


def test_an_endpoint_without_nixl_names_the_extra() -> None:
    pytest.importorskip("torch", reason="kvgeom_nixl needs torch")
    got = _without("nixl,nixl_cu13,nixl_cu12", """
        from kvgeom_nixl.agent import make_agent
        make_agent("x")
    """)
    assert got["typed"] and got["path"] == "nixl" and "[nixl]" in got["fix"]


def test_one_cuda_flavour_of_nixl_is_enough() -> None:
    """Issue 20 (9): the ``nixl`` meta package installs nixl-cu12 and nixl-cu13 both; with one
    flavour installed alone (the ``dev`` extra on a CPU machine) kvgeom_nixl finds NIXL there."""
    pytest.importorskip("torch", reason="kvgeom_nixl needs torch")
    from nixl_env import NIXL_API

    pytest.importorskip(NIXL_API, reason="needs NIXL")
    flavours = [m for m in ("nixl_cu13", "nixl_cu12") if _without("no-such-module", f"import {m}")["type"] is None]
    if not flavours:
        pytest.skip("only the nixl meta package is importable here")
    blocked = ",".join(["nixl"] + [m for m in ("nixl_cu13", "nixl_cu12") if m != flavours[0]])
    got = _without(blocked, f"""
        from kvgeom_nixl.agent import nixl_api, nixl_errors, make_agent
        assert nixl_api().__name__ == "{flavours[0]}._api", nixl_api().__name__
        assert len(nixl_errors()) > 5
        make_agent("kvgeom-flavour-check")
    """)
    assert got["type"] is None, got


def test_draw_without_matplotlib_names_the_extra() -> None:
    got = _without("matplotlib", """
        from kvgeom import draw
        from kvgeom.building import get_preset
        pair, request = get_preset("gqa-tp2-tp4").build(16, layers=1)
        draw(pair.plan(request), pair, request)
    """)
    assert got["typed"] and got["value_error"] and got["path"] == "matplotlib" and "[notebook]" in got["fix"]
