"""Smoke test of the benchmark runner (``python -m benchmarks``): schema and arithmetic, no timing.

The planning and descriptor sections run in-process on tiny sizes; the NIXL sections are not run
here (tests/test_nixl_*.py cover the executor). Nothing here asserts a speed.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import attrs
import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # `pytest` (not `python -m pytest`) does not put the repo root on the path
    sys.path.insert(0, str(ROOT))

from benchmarks import SECTIONS, Config, render_table, run, to_json_list  # noqa: E402
from benchmarks.__main__ import main  # noqa: E402
from benchmarks.cases import PATTERNS, build_case, draw_blocks, pattern_request  # noqa: E402
from benchmarks.descriptors import per_block_descriptors  # noqa: E402

KEYS = {"name": str, "value": float, "unit": str, "baseline": float, "ratio": float}


def _tiny() -> Config:
    return attrs.evolve(
        Config.quick_config(),
        plan_tokens=(256, 512),
        plan_repeats=1,
        big_repeats=1,
        memory_tokens=512,
        desc_tokens=512,
        plan_presets=("deepseek-v3-tp8-tp1", "kimi-linear-tp8-tp1"),
        plan_synthetic=("syn-tp1-tp1", "syn-tp4-tp1"),
        desc_presets=("llama3-70b-tp8-tp4", "qwen-swa-tp2-tp4"),
        desc_synthetic=("syn-tp1-tp1-inner",),
    )


def _check_schema(rows: list[dict[str, object]]) -> None:
    assert rows, "no measurements"
    names = [r["name"] for r in rows]
    assert len(set(names)) == len(names), "measurement names repeat"
    for r in rows:
        for key, kind in KEYS.items():
            assert isinstance(r[key], kind), (r["name"], key, r[key])
        value, baseline, ratio = float(r["value"]), float(r["baseline"]), float(r["ratio"])  # type: ignore[arg-type]
        assert baseline > 0, r
        assert math.isfinite(ratio), r
        assert ratio == pytest.approx(value / baseline), r
        if r["unit"] != "exponent":  # a fitted exponent may be <= 0 when the time does not grow
            assert ratio > 0, r
        assert r["section"] in SECTIONS
        assert r["met"] in (True, False, None)


def test_plan_and_descriptor_sections_give_the_schema() -> None:
    config = _tiny()
    ms = run(config, only=("plan", "memory", "descriptors"))
    rows = json.loads(json.dumps(to_json_list(ms)))
    _check_schema(rows)
    names = {r["name"] for r in rows}
    # 4 pairs x (compile + fixed cost + 2 sizes x 2 patterns x (compiled, reference, compiled vs reference)
    # + exponent)
    assert sum(r["section"] == "plan" for r in rows) == 4 * (2 + 2 * 2 * 3 + 1)
    assert "plan/syn-tp1-tp1/exponent" in names
    assert {"plan/syn-tp4-tp1/scattered/512", "plan/syn-tp4-tp1/scattered/512/reference",
            "plan/syn-tp4-tp1/scattered/512/vs-reference", "plan/kimi-linear-tp8-tp1/fixed",
            "compile/deepseek-v3-tp8-tp1"} <= names
    # 4 pairs x 2 patterns x (compiled, reference)
    assert sum(r["section"] == "memory" for r in rows) == 4 * 2 * 2
    # the compiled and reference rows of one request describe the same plan
    by_name = {r["name"]: r for r in rows}
    assert by_name["plan/syn-tp4-tp1/fresh/256"]["baseline"] == by_name["plan/syn-tp4-tp1/fresh/256/reference"]["baseline"]
    # 3 pairs x 3 patterns + one geometric mean per pattern
    assert sum(r["section"] == "descriptors" for r in rows) == 3 * 3 + 3
    for p in PATTERNS:
        assert f"descriptors/{p}/geomean" in names
    # the ratio goal applies from 16k tokens on: at these sizes only exponents, fixed costs and compile
    # times are judged
    judged = {r["name"] for r in rows if r["section"] == "plan" and r["met"] is not None}
    assert all(n.endswith(("exponent", "fixed")) or n.startswith("compile/") for n in judged)
    table = render_table(ms)
    assert "plan/deepseek-v3-tp8-tp1/fresh/512" in table and "goals:" in table


def test_cli_json_is_a_list_of_measurements(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--quick", "--only", "descriptors", "--json", "--no-progress"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert isinstance(rows, list)
    _check_schema(rows)
    assert {r["section"] for r in rows} == {"descriptors"}


def test_cli_rejects_an_unknown_section(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--only", "plan,warp"]) == 2
    assert "warp" in capsys.readouterr().err


def test_per_block_count_worked_number() -> None:
    # syn-tp1-tp1: 32 layers, one region each, K/V packed as the page's outer mode (2 streams),
    # M = 1024 tokens in 16-token pages = 64 units, one source rank: 32 * 2 * 64 * 1 = 4096.
    case = build_case("syn-tp1-tp1", 1024)
    assert per_block_descriptors(case.pair, case.fresh()) == 32 * 2 * 64 * 1
    # Same with K/V inner ([H, N, 2*D], one stream) and P TP2 -> D TP4: each of 4 D ranks reads
    # its 2 heads from one P rank: 4 ranks * 32 regions * 1 stream * 64 units * 1 source = 8192.
    case = build_case("syn-tp2-tp4-inner", 1024)
    assert per_block_descriptors(case.pair, case.fresh()) == 4 * 32 * 64
    # P TP4 -> D TP1: the one D rank reads every page from 4 P ranks: 32 * 2 * 64 * 4 = 16384.
    case = build_case("syn-tp4-tp1", 1024)
    assert per_block_descriptors(case.pair, case.fresh()) == 32 * 2 * 64 * 4


def test_draw_blocks_patterns() -> None:
    rng = np.random.default_rng(3)
    assert draw_blocks("fresh", 50, 5, rng).tolist() == [0, 1, 2, 3, 4]
    for pattern in ("fragmented", "scattered"):
        ids = draw_blocks(pattern, 400, 200, rng)
        assert len(ids) == 200 and len(set(ids.tolist())) == 200
        assert ids.min() >= 0 and ids.max() < 400
    frag = draw_blocks("fragmented", 400, 400, rng)
    assert sorted(frag.tolist()) == list(range(400))
    runs = np.split(frag, np.flatnonzero(np.diff(frag) != 1) + 1)
    # runs of 1..16 ids, shuffled: at least 400 / 16 = 25 drawn runs; two of them rarely continue
    # each other, so far more than 12 maximal runs remain (a sorted pool would leave 1)
    assert len(runs) > 12
    with pytest.raises(ValueError):
        draw_blocks("sorted", 10, 2, rng)


def test_pattern_request_keeps_hybrid_groups_apart() -> None:
    # KimiLinear overlays three groups on shared regions: drawn ids must stay distinct across them.
    case = build_case("kimi-linear-tp8-tp1", 2000, pool_factor=2.0)
    request = pattern_request(case, "scattered", np.random.default_rng(0))
    case.pair.check_request(request)  # raises RequestError if two groups of a region share a block
    plan = case.pair.plan(request)
    assert len(plan.copies) > 0


def test_plan_profile_names_the_case_and_its_sizes() -> None:
    from benchmarks.plan_profile import profile_plan

    text = profile_plan("syn-tp1-tp1", 256, repeats=1, top=5)
    # 32 layers, fresh blocks on identical HND layouts: every page is one whole-page run on both
    # sides, so the 256 / 16 = 16 consecutive pages of a layer collapse before the rows are built:
    # 32 rows before coalescing, 32 copies after
    assert text.startswith("syn-tp1-tp1 M=256 fresh compiled strategy=direct: 32 copies, 0 zeros, "
                           "32 rows before coalescing")
    assert "ncalls" in text
    assert profile_plan("syn-tp4-tp1", 256, repeats=1, top=5, path="reference", pattern="scattered").startswith(
        "syn-tp4-tp1 M=256 scattered reference strategy=direct")


def test_hostile_campaigns_run_and_render() -> None:
    """``python -m benchmarks.hostile`` in miniature: workers, the watchdog and the table (no timing asserted)."""
    from benchmarks import hostile

    tallies = [hostile.campaign("api", 12, jobs=1), hostile.campaign("files", 6, jobs=1)]
    for t in tallies:
        assert t.tried == sum(t.counts.values()) and t.counts["other"] == t.counts["hang"] == 0
    text = hostile.render(tallies, title="mini")
    assert "API values" in text and "pair files" in text and "max refusal ms" in text
    assert hostile.main(["--only", "api", "--count", "api=3", "--jobs", "1"]) == 0


def test_packed_section_gives_the_schema() -> None:
    """The packed section at a tiny size: every row, goals judged only from 16k tokens on (the
    descriptor bound always). Needs NIXL; nothing here asserts a speed."""
    from nixl_env import NIXL_API
    pytest.importorskip(NIXL_API, reason="the packed section needs the nixl extra")
    config = attrs.evolve(_tiny(), packed_tokens=256, transfer_repeats=1, packed_baseline_repeats=1)
    rows = json.loads(json.dumps(to_json_list(run(config, only=("packed",)))))
    _check_schema(rows)
    names = {r["name"] for r in rows}
    for pair in ("gqa-tp2-tp4", "llama3-70b-tp8-tp4", "syn-nhd-tp2-hnd-tp4"):
        for part in ("descriptors", "wire", "e2e", "pack", "unpack"):
            assert f"transfer/packed/{pair}/256/{part}" in names
        assert f"transfer/direct/{pair}/256" in names
    assert "plan/packed/llama3-70b-tp8-tp4/256" in names
    assert "plan/packed/syn-cpu-attn-k32-k64/256" in names  # per-plane pages (docs/design.md §3.5)
    desc = [r for r in rows if r["name"].endswith("/descriptors")]
    assert all(r["met"] is True and r["value"] < r["baseline"] for r in desc)
    assert all(r["met"] is None for r in rows if r["name"].endswith(("/wire", "/e2e")))  # 256 < 16k tokens


def test_connector_overhead_runs_every_variant() -> None:
    """``python -m benchmarks.connector_overhead`` in miniature: every D executor pulls both cells
    (the recipe variants from their recipes: ``measure`` raises otherwise); nothing asserts a speed."""
    pytest.importorskip("torch")
    from nixl_env import NIXL_API
    pytest.importorskip(NIXL_API, reason="the connector benchmark needs the nixl extra")
    from benchmarks import connector_overhead

    samples = connector_overhead.measure(256, 2)
    assert {v: {k: len(x) for k, x in s.items()} for v, s in samples.items()} == {
        v: {k: 2 for k in connector_overhead.KINDS} for v in (*connector_overhead.VARIANTS, *connector_overhead.PARTS)}
    assert all(x > 0 for s in samples.values() for xs in s.values() for x in xs)
    text = connector_overhead.render(samples, 256, "1.0")
    assert "256-token prompt" in text and "prefix hit (D holds 256" in text and "eager/planned" in text
    assert text.count("the READ's posting") == 2


def test_connector_packed_runs_both_paths() -> None:
    """``python -m benchmarks.connector_packed`` in miniature: the direct D pulls direct and the
    packed D packed (``measure`` raises when a variant took the other path), every request timed,
    P's packing measured only where P packed; nothing asserts a speed."""
    pytest.importorskip("torch")
    from nixl_env import NIXL_API
    pytest.importorskip(NIXL_API, reason="the connector benchmark needs the nixl extra")
    from benchmarks import connector_packed

    samples = connector_packed.measure([100, 517], 2)
    assert list(samples) == [100, 517]
    for cell in samples.values():
        assert {v: {k: len(x) for k, x in c.items()} for v, c in cell.items()} == {
            v: {k: 2 for k in connector_packed.METRICS} for v in connector_packed.VARIANTS}
        assert all(x > 0 for v in cell.values() for x in v["wall"] + v["d_cpu"])
        assert all(x == 0 for x in cell["direct"]["p_pack"]) and all(x > 0 for x in cell["packed"]["p_pack"])
        assert cell["direct"]["packed"] == [0.0, 0.0] and cell["packed"]["packed"] == [1.0, 1.0]
        assert cell["auto"]["packed"] == [0.0, 0.0]  # short prompts: the 12 ms setup makes auto go direct
    text = connector_packed.render(samples, "1.0")
    assert "517-token prompt" in text and "packed/direct" in text and text.count("P packing CPU") == 2
    assert text.count("auto packed 0% of its pulls") == 2


def test_connector_overhead_key_table_times_both_keys() -> None:
    """The recipe-key table in miniature: both keys timed for each context, one row each; the
    whole-list key really reads P's whole list (it is the slower one at 4k P ids, by far more than
    the machine's noise: 4097 ids against 1), nothing else about speed is asserted."""
    from benchmarks import connector_overhead

    costs = connector_overhead.key_costs((256, 131072), number=20)
    assert list(costs) == [256, 131072] and all(x > 0 for pair in costs.values() for x in pair)
    past, whole = costs[131072]
    assert whole > 3 * past, costs
    text = connector_overhead.render_keys(costs)
    assert "after 256 tokens (9 P ids)" in text and "after 131072 tokens (4097 P ids)" in text
