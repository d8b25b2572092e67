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


def test_nixl_extra_pins_the_same_torch() -> None:
    pyproject = (README.parent / "pyproject.toml").read_text()
    assert re.search(r'^nixl = \[.*"torch==2\.13\.0".*\]$', pyproject, re.M)


def test_readme_python_example_runs() -> None:
    blocks = _blocks("python")
    assert blocks, "the README has no python example"
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(blocks[0], str(README), "exec"), {"__name__": "readme"})  # our own README
    assert "TransferPlan P TP2 -> D TP4" in out.getvalue()


def test_readme_executor_example_pulls_a_request_with_real_nixl() -> None:
    """The executor block runs as written after a prelude that defines its free names (a TP1 -> TP1
    pair in CPU memory), and every D byte is then checked by the simulator."""
    pytest.importorskip("nixl._api", reason="the executor example needs the nixl extra")
    from kvgeom import AttentionSpec, EngineGeometry, ModelSpec, Pair, fresh_request
    from kvgeom.checking import check_decode, fill_decode, fill_prefill
    from kvgeom_nixl.local import allocate_caches, host_memory

    (code,) = [b for b in _blocks("python") if "kvgeom_nixl" in b]
    model = ModelSpec("m", [AttentionSpec("attn", "full", 2, 4, 64)])
    prefill_geometry = EngineGeometry.build(model, tp=1, kernel_block_tokens=16, num_blocks=8, layout="NHD",
                                            name="prefill")
    decode_geometry = EngineGeometry.build(model, tp=1, kernel_block_tokens=8, num_blocks=16, name="decode")
    pair = Pair(prefill_geometry, decode_geometry)
    request = fresh_request(pair, 50)
    p_caches, d_caches = allocate_caches(prefill_geometry), allocate_caches(decode_geometry)
    fill_prefill(pair, request, host_memory(prefill_geometry, p_caches))
    fill_decode(pair, request, host_memory(decode_geometry, d_caches))
    scope = {"__name__": "readme", "prefill_geometry": prefill_geometry, "decode_geometry": decode_geometry,
             "rank": 0, "p_cache_tensors": p_caches[0], "d_cache_tensors": d_caches[0], "request": request,
             "recompute": lambda blocks: pytest.fail(f"transfer failed, recompute {blocks}")}
    exec(compile(code, str(README), "exec"), scope)  # our own README
    assert scope["result"] is not None
    violations, checked = check_decode(pair, request, host_memory(decode_geometry, d_caches))
    assert not violations and checked == decode_geometry.regions[0].nbytes * len(decode_geometry.regions)


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
