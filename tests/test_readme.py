"""The README's promises: it opens with the two commands, and its Python example runs as written."""

from __future__ import annotations

import contextlib
import io
import re
from pathlib import Path

import pytest

README = Path(__file__).resolve().parent.parent / "README.md"


def _blocks(lang: str) -> list[str]:
    return re.findall(rf"^```{lang}\n(.*?)^```", README.read_text(), re.M | re.S)


def test_readme_opens_with_the_two_commands() -> None:
    text = README.read_text()
    first = re.findall(r"^```bash\n(.*?)\n```", text, re.M | re.S)[:2]
    assert first == ['pip install torch==2.13.0 && pip install -e ".[dev]" && kvgeom plan',
                     'pip install torch==2.13.0 && pip install -e ".[dev]" && pytest']
    before = text.split("```bash", 1)[0]
    assert before.strip() == "# kvgeom"  # nothing but the title comes before them


def test_ci_pins_the_torch_the_readme_installs() -> None:
    """The README installs torch 2.13.0 first; the package states a range that admits it, and CI
    pins that exact version (issue 20, item 9: pins belong to CI, ranges to the package)."""
    pyproject = (README.parent / "pyproject.toml").read_text()
    assert re.search(r'^nixl = \[.*"torch>=2\.\d+".*\]$', pyproject, re.M)
    assert "torch==2.13.0" in (README.parent / "ci" / "constraints.txt").read_text().splitlines()


def test_readme_python_example_runs() -> None:
    blocks = _blocks("python")
    assert blocks, "the README has no python example"
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(blocks[0], str(README), "exec"), {"__name__": "readme"})  # our own README
    assert "TransferPlan P TP2 -> D TP4" in out.getvalue()


def test_readme_executor_example_pulls_a_request_with_real_nixl() -> None:
    """Issue 20 (1): the executor block runs as written, tensors -> geometry -> endpoints -> pull ->
    verify, registering the very LayerTensors from_tensors read. Checked again here: every D byte by
    hand (token t of layer l, plane kv: P block t // 16, slot t % 16; D block t // 8, slot t % 8), and
    the tokens D lists beyond 50 are zero."""
    from nixl_env import NIXL_API
    pytest.importorskip(NIXL_API, reason="the executor example needs the nixl extra")
    torch = pytest.importorskip("torch", reason="the executor example needs torch")

    (code,) = [b for b in _blocks("python") if "kvgeom_nixl" in b and "Progressor" not in b]
    assert "prefill_geometry" not in code and "p_cache_tensors" not in code  # no free names
    scope: dict[str, object] = {"__name__": "readme"}
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(code, str(README), "exec"), scope)  # our own README
    assert out.getvalue() == ""  # neither kvgeom_nixl nor NIXL prints
    p_caches, d_caches = scope["p_caches"], scope["d_caches"]
    for pc, dc in zip(p_caches, d_caches):  # type: ignore[call-overload]
        want = torch.zeros_like(dc)
        for t in range(50):
            want[t // 8, :, :, t % 8] = pc[:, t // 16, t % 16]
        assert torch.equal(dc, want)  # blocks 0..6 as P's tokens [0, 50) and zeros; block 7.. untouched
        assert pc.abs().sum() > 0  # the control: P's caches hold data, so equality means it moved


def test_readme_connector_calls_run_with_real_nixl() -> None:
    """The connector block of "The executor from any engine's connector": P holds, a Progressor
    progresses P, D pulls and polls get_finished; D's regions then hold P's bytes (the same HND
    geometry on both sides: pages of 2 x 4 rows of 16 tokens x 256 B; 40 tokens are blocks 0-1 and
    the first 8 token slots of each row of block 2)."""
    from nixl_env import NIXL_API
    pytest.importorskip(NIXL_API, reason="the executor example needs the nixl extra")
    torch = pytest.importorskip("torch", reason="the executor example needs torch")

    (code,) = [b for b in _blocks("python") if "Progressor" in b]
    scope: dict[str, object] = {"__name__": "readme"}
    exec(compile(code, str(README), "exec"), scope)  # our own README
    engine, p_cache, d_cache = scope["engine"], scope["p_cache"], scope["d_cache"]
    assert engine.summary().endswith("[attn:full/HND packed] 2 regions")  # type: ignore[attr-defined]
    for pc, dc in zip(p_cache, d_cache, strict=True):  # type: ignore[call-overload]
        pv, dv = pc.view(8, 8, 16, 256), dc.view(8, 8, 16, 256)  # page, (K|V, head), token, bytes
        assert torch.equal(dv[:2], pv[:2]) and torch.equal(dv[2, :, :8], pv[2, :, :8])  # tokens 0..39
        assert not dv[2, :, 8:].any() and not dv[3:].any()  # nothing else written
        assert pv[:3].any()  # the control: P's bytes are not D's starting zeros


def test_readme_strategies_example_runs_against_the_planner() -> None:
    """The connector-test snippet, with kvgeom's own planner standing in for the connector."""
    pytest.importorskip("hypothesis", reason="the strategies need the testing extra")
    from hypothesis import settings

    from kvgeom import plan_transfer

    (code,) = [b for b in _blocks("python") if "strategies as kst" in b]
    scope = {"__name__": "readme", "my_connector_plan": plan_transfer}
    exec(compile(code, str(README), "exec"), scope)  # our own README
    settings(max_examples=20, deadline=None, derandomize=True, database=None)(scope["test_my_connector"])()


def _run_block(marker: str) -> str:
    (code,) = [b for b in _blocks("python") if marker in b]
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(code, str(README), "exec"), {"__name__": "readme"})  # our own README
    return out.getvalue()


def test_readme_connector_walkthrough_runs() -> None:
    """tensors -> geometry -> handshake -> request from block tables -> plan -> per-rank rows."""
    pytest.importorskip("torch", reason="the walkthrough reads torch cache tensors")
    out = _run_block("request_from_block_tables(pair, 100")
    assert "Request.groups[0](attn).prefill -> lists tokens [0, 64)" in out and "needs [0, 100)" in out
    assert out.count("copies from P ranks") == 4


def test_readme_vllm_config_example_runs() -> None:
    out = _run_block("engine_from_vllm_config(config")
    assert "32 regions" in out  # vLLM 0.32: one region per layer, K | V in each cell


def test_readme_conformance_example_catches_the_stale_tail() -> None:
    out = _run_block("check_connector(pair, request, rows")
    assert out.startswith("does not conform") and out.count("not_zeroed: ") == 2
