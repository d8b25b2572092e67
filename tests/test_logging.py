"""Logging and the error family: the ``kvgeom`` / ``kvgeom_nixl`` loggers, no prints in library code,
and InternalError kept apart from bad input (it is not a ValueError)."""

from __future__ import annotations

import ast
import logging
import pickle
from pathlib import Path
from typing import Any

import pytest

from kvgeom import (
    AttentionSpec,
    EngineGeometry,
    InternalError,
    KvGeomError,
    ModelSpec,
    Pair,
    fresh_request,
)
from kvgeom.building import get_preset
from kvgeom.tools import cli

ROOT = Path(__file__).resolve().parent.parent
# the command line prints, that is its job: the cli module, and the body of the ``kvgeom fuzz`` subcommand
PRINTING = {"kvgeom/tools/cli.py": None, "kvgeom/tools/fuzz.py": "run_fuzz",
            "kvgeom_nixl/vllm/conformance.py": "main"}  # its command line prints the grid


def test_internal_error_is_not_bad_input() -> None:
    err = InternalError("rows out of order", path="planning.rows", actual=3, expected=2)
    assert not isinstance(err, ValueError) and not isinstance(err, KvGeomError)
    assert (err.path, err.actual, err.expected, err.fix) == ("planning.rows", 3, 2, "report this as a kvgeom bug")
    assert str(err) == ("planning.rows: internal invariant broken: rows out of order "
                        "(expected: 2; fix: report this as a kvgeom bug)")
    back = pickle.loads(pickle.dumps(err))
    assert type(back) is InternalError and str(back) == str(err) and back.actual == 3
    with pytest.raises(InternalError):  # an ``except ValueError`` for bad input lets it through
        try:
            raise err
        except ValueError:
            pytest.fail("InternalError was caught as a ValueError")


def test_the_cli_reports_an_internal_error_as_one_and_exits_1(capsys: pytest.CaptureFixture[str],
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    def boom(*args: Any, **kwargs: Any) -> Any:
        raise InternalError("a plan row escaped its page")

    monkeypatch.setattr(cli, "plan_pair", boom)
    assert cli.main(["plan"]) == 1  # bad input exits 2; a kvgeom bug is not bad input
    assert "internal error: InternalError: kvgeom: internal invariant broken" in capsys.readouterr().err


def _print_calls(path: Path, allowed_function: str | None = "") -> list[int]:
    """Lines of ``print(...)`` calls, except inside the function named ``allowed_function``
    (``None``: the whole file may print)."""
    if allowed_function is None:
        return []
    tree = ast.parse(path.read_text())
    allowed: set[int] = set()
    for fn in ast.walk(tree):
        if isinstance(fn, ast.FunctionDef) and fn.name == allowed_function:
            allowed |= {id(n) for n in ast.walk(fn)}
    return [n.lineno for n in ast.walk(tree) if isinstance(n, ast.Call) and getattr(n.func, "id", None) == "print"
            and id(n) not in allowed]


def test_no_prints_in_library_code() -> None:
    found = {}
    for pkg in ("kvgeom", "kvgeom_nixl"):
        for f in sorted((ROOT / pkg).rglob("*.py")):
            rel = f.relative_to(ROOT).as_posix()
            lines = _print_calls(f, PRINTING.get(rel, ""))
            if lines:
                found[rel] = lines
    assert found == {}
    assert _print_calls(ROOT / "kvgeom/tools/cli.py")  # the scan sees prints where they are
    assert _print_calls(ROOT / "kvgeom/tools/fuzz.py")


def test_loggers_are_children_of_the_package_loggers_with_null_handlers() -> None:
    import kvgeom_nixl  # noqa: F401 - attaches its NullHandler

    for name in ("kvgeom", "kvgeom_nixl"):
        assert any(isinstance(h, logging.NullHandler) for h in logging.getLogger(name).handlers)
    for pkg in ("kvgeom", "kvgeom_nixl"):
        for f in (ROOT / pkg).rglob("*.py"):
            text = f.read_text()
            if "getLogger(" in text:
                assert "logging.getLogger(__name__)" in text, f  # module loggers, never a name of their own


def test_pair_checks_and_strategy_decisions_log_at_debug(caplog: pytest.LogCaptureFixture) -> None:
    model = ModelSpec("m", [AttentionSpec("attn", "full", 1, 2, 256)])
    p = EngineGeometry.build(model, tp=1, kernel_block_tokens=4, num_blocks=4, layout="HND", name="prefill")
    d = EngineGeometry.build(model, tp=1, kernel_block_tokens=8, num_blocks=4, layout="NHD", name="decode")
    with caplog.at_level(logging.DEBUG, logger="kvgeom"):
        pair = Pair(p, d)
        request = fresh_request(pair, 8)
        pair.plan(request, strategy="auto")
    by = {(r.name, r.levelname) for r in caplog.records}
    assert ("kvgeom.values.pair", "DEBUG") in by
    assert ("kvgeom.planning.choose", "DEBUG") in by  # auto: direct 32 copies vs staged 2 copies + rearrange
    assert any("-> staged" in r.getMessage() for r in caplog.records if r.name == "kvgeom.planning.choose")
    assert ("kvgeom.planning.transfer", "DEBUG") in by


def test_a_staged_fallback_logs_a_warning(caplog: pytest.LogCaptureFixture) -> None:
    model = ModelSpec("m", [AttentionSpec("attn", "full", 1, 2, 8)])
    p = EngineGeometry.build(model, tp=1, kernel_block_tokens=12, num_blocks=4, name="prefill")
    d = EngineGeometry.build(model, tp=1, kernel_block_tokens=8, num_blocks=6, layout="NHD", name="decode")
    pair = Pair(p, d)  # 12 and 8: neither kernel page a multiple of the other, so staged does not apply
    with caplog.at_level(logging.WARNING, logger="kvgeom"):
        pair.plan(fresh_request(pair, 24), strategy="staged")
    assert [r.name for r in caplog.records if r.levelno == logging.WARNING] == ["kvgeom.planning.choose"]


def test_an_executor_transfer_logs_its_summary_at_info(caplog: pytest.LogCaptureFixture) -> None:
    from nixl_env import NIXL_API
    pytest.importorskip(NIXL_API, reason="the executor needs the nixl extra")
    from kvgeom_nixl.testing import run_local

    pair, request = get_preset("gqa-tp2-tp4").build(layers=1)
    with caplog.at_level(logging.INFO, logger="kvgeom_nixl"):
        out = run_local(pair, request)
    assert not out["violations"]
    done = [r for r in caplog.records if r.name == "kvgeom_nixl.transfer" and r.levelno == logging.INFO]
    assert len(done) >= pair.decode.tp  # one summary per finished transfer, at least every D rank's pull
    assert all("done:" in r.getMessage() for r in done)


_ENDPOINT_SCRIPT = """
import logging, sys
from kvgeom import AttentionSpec, EngineGeometry, ModelSpec
from kvgeom_nixl import Endpoint
from kvgeom_nixl.local import allocate_caches
model = ModelSpec("m", [AttentionSpec("attn", "full", 1, 2, 64)])
g = EngineGeometry.build(model, tp=1, kernel_block_tokens=16, num_blocks=4, name="prefill")
e = Endpoint(g, "prefill", 0, allocate_caches(g)[0])
e.close()
print(logging.getLogger("nixl").getEffectiveLevel(), file=sys.stderr)
"""


def _endpoint_stdout(**env: str) -> tuple[str, str]:
    import os
    import subprocess
    import sys

    base = {k: v for k, v in os.environ.items() if k != "NIXL_LOG_LEVEL"}
    base.update(UCX_NET_DEVICES="lo", PYTHONPATH=str(ROOT), **env)
    done = subprocess.run([sys.executable, "-c", _ENDPOINT_SCRIPT], capture_output=True, text=True, env=base,
                          cwd=ROOT, timeout=120, check=True)
    return done.stdout, done.stderr


def test_an_endpoint_prints_nothing_without_nixl_log_level() -> None:
    """Issue 20 (2): NIXL logs at INFO on stdout unless told otherwise; kvgeom_nixl sets its level
    (``kvgeom_nixl.agent.NIXL_LOG_LEVEL``), and ``NIXL_LOG_LEVEL`` set by the user still wins."""
    from nixl_env import NIXL_API
    pytest.importorskip(NIXL_API, reason="the executor needs the nixl extra")
    out, err = _endpoint_stdout()
    assert out == "" and err.strip().splitlines()[-1] == str(logging.WARNING)
    out, err = _endpoint_stdout(NIXL_LOG_LEVEL="INFO")  # the control: the user's level is NIXL's
    assert "Backend UCX was instantiated" in out and err.strip().splitlines()[-1] == str(logging.INFO)
