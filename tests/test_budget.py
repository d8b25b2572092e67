"""The work budget (docs/design.md §14): the estimate bounds the real plan, and a plan beyond the budget is
refused before it is built.

The property tests plan drawn pairs for real and compare: the estimate is never below the rows the
planner built (copies and zeros before coalescing, rearranged page entries), and where no pages are
consecutive on both sides (P's block ids reversed, so no whole-page run forms) it is at most
2 x ppl times the real count: an upper bound that is not absurdly loose. Packed plans (drawn with a
staging capacity that cuts them into chunks, layers, token ranges or state sections) are bounded in
chunks, wire rows, pack/unpack steps and their entries, in closed form and with the classes counted
on windows of the tokens.
"""

from __future__ import annotations

import time
from typing import Any

import pytest

pytest.importorskip("hypothesis", reason="the property tests need the testing extra (hypothesis)")

from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from kvgeom import (  # noqa: E402
    DEFAULT_BUDGET,
    AttentionSpec,
    BlockList,
    EngineGeometry,
    GeometryError,
    GroupRequest,
    KvGeomError,
    ModelSpec,
    Pair,
    PlanBudget,
    PlanBudgetExceeded,
    Request,
    RequestShape,
    estimate_plan,
    fresh_request,
    plan_pair,
    plan_reference,
    plan_transfer,
)
from kvgeom.building import fresh_shape, get_preset  # noqa: E402
from kvgeom.planning import budget as budget_module  # noqa: E402
from kvgeom.planning import estimate_packed, min_staging_bytes  # noqa: E402
from kvgeom.tools import strategies as kst  # noqa: E402

TRANSFERS = kst.transfers(pairs=kst.pairs(mismatch_probability=0.0, max_tokens=96), max_tokens=96)
SETTINGS = settings(max_examples=250, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
PACKED = kst.packed_transfers(transfers=kst.transfers(pairs=kst.pairs(mismatch_probability=0.0, max_tokens=200),
                                                      max_tokens=200))
LONG_PACKED = kst.packed_transfers(transfers=kst.transfers(pairs=kst.pairs(mismatch_probability=0.0,
                                                                           max_tokens=2000), max_tokens=2000))


def _reverse_prefill(request: Request) -> Request:
    """The same request with every P listing in reverse id order: no two consecutive P blocks are
    consecutive ids, so no run of whole pages collapses into one row."""
    groups = []
    for g in request.groups:
        if isinstance(g.prefill, BlockList):
            g = GroupRequest(BlockList(tuple(reversed(g.prefill.block_ids)), g.prefill.first_token), g.decode)
        groups.append(g)
    return Request(request.computed_tokens, groups, request.prefix_hit_tokens, partial=request.partial)


@SETTINGS
@given(TRANSFERS, st.sampled_from(("direct", "staged", "auto")))
def test_the_estimate_is_an_upper_bound_of_the_real_plan(t: Any, strategy: str) -> None:
    pair = Pair(*t.pair)
    plan = plan_pair(pair, t.request, strategy=strategy, budget=None)
    est = estimate_plan(pair, RequestShape.of(t.request), strategy)
    assert est.copy_rows >= plan.copies_before_coalescing
    assert est.zero_rows >= plan.zeros_before_coalescing
    assert est.rearrange_pages >= sum(len(r.pages) for r in plan.rearranges)
    assert est.bytes > 0 and est.work >= est.copy_rows + est.zero_rows


@SETTINGS
@given(TRANSFERS, st.sampled_from(("direct", "staged")))
def test_the_estimate_is_not_loose_where_no_pages_collapse(t: Any, strategy: str) -> None:
    pair = Pair(*t.pair)
    request = _reverse_prefill(t.request)
    pair.check_request(request)
    plan = plan_pair(pair, request, strategy=strategy, budget=None)
    est = estimate_plan(pair, RequestShape.of(request), strategy)
    ppl = max(pair.prefill.blocks_per_logical, pair.decode.blocks_per_logical)
    assert plan.copies_before_coalescing <= est.copy_rows <= 2 * ppl * plan.copies_before_coalescing + 16


def _packed_bound(t: Any) -> None:
    pair = Pair(*t.pair)
    plan = plan_pair(pair, t.request, strategy="packed", staging_bytes=t.staging_bytes, budget=None)
    est = estimate_plan(pair, RequestShape.of(t.request), "packed", staging_bytes=t.staging_bytes)
    steps = plan.packs + plan.unpacks
    assert est.chunks >= len(plan.chunks) and est.wire_rows >= len(plan.wire)
    assert est.staging_steps >= len(steps)
    assert est.staging_entries >= sum(len(s.pages) + len(s.regions) for s in steps)
    assert est.zero_rows >= plan.zeros_before_coalescing and est.copy_rows == len(plan.copies) == 0


@SETTINGS
@given(PACKED)
def test_the_packed_estimate_is_an_upper_bound_of_the_real_plan(t: Any) -> None:
    _packed_bound(t)


@settings(max_examples=40, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(LONG_PACKED)
def test_the_packed_estimate_counted_on_windows_is_an_upper_bound(t: Any) -> None:
    """Classes counted on a head and a tail window of long token ranges (every estimate counts them)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(estimate_packed, "REFINE_STEPS", 0)
        _packed_bound(t)


@SETTINGS
@given(PACKED)
def test_auto_counts_the_packed_candidate(t: Any) -> None:
    pair = Pair(*t.pair)
    plan = plan_pair(pair, t.request, strategy="auto", staging_bytes=t.staging_bytes, budget=None)
    est = estimate_plan(pair, RequestShape.of(t.request), "auto", staging_bytes=t.staging_bytes)
    assert est.copy_rows >= plan.copies_before_coalescing and est.wire_rows >= len(plan.wire)
    assert est.staging_steps >= len(plan.packs) + len(plan.unpacks)


@SETTINGS
@given(PACKED, st.sampled_from(("direct", "staged", "auto", "packed")))
def test_the_quick_bound_is_an_upper_bound_of_the_real_plan(t: Any, strategy: str) -> None:
    """The O(groups) bound the planner admits a request with first (rows per moved token x tokens)."""
    pair = Pair(*t.pair)
    plan = plan_pair(pair, t.request, strategy=strategy, staging_bytes=t.staging_bytes, budget=None)
    q = budget_module.quick_estimate(pair, RequestShape.of(t.request), strategy, staging_bytes=t.staging_bytes)
    steps = plan.packs + plan.unpacks
    assert q.copy_rows >= plan.copies_before_coalescing and q.zero_rows >= plan.zeros_before_coalescing
    assert q.rearrange_pages >= sum(len(r.pages) for r in plan.rearranges)
    assert q.chunks >= len(plan.chunks) and q.wire_rows >= len(plan.wire) and q.staging_steps >= len(steps)
    assert q.staging_entries >= sum(len(s.pages) + len(s.regions) for s in steps)


def test_a_tiny_staging_capacity_is_refused_before_planning() -> None:
    """One token per chunk: llama3-70b TP8 -> TP4 at 131,072 tokens would cut 80 layers into 10M chunks;
    refused from the estimate (no chunk is laid out). Auto leaves packed out and plans direct."""
    pair, request = get_preset("llama3-70b-tp8-tp4").build(131072, 0, layers=4, budget=None, strategy="direct")
    tiny = min_staging_bytes(pair, request)
    t0 = time.perf_counter()
    with pytest.raises(PlanBudgetExceeded, match="chunks"):
        plan_pair(pair, request, strategy="packed", staging_bytes=tiny)
    assert time.perf_counter() - t0 < 60  # a generous ceiling: planning it would take hours
    plan = plan_pair(pair, request, strategy="auto", staging_bytes=tiny)
    over = [n for n in plan.notes if n.kind.name == "AUTO_OVER_BUDGET"]
    assert not plan.packed and len(over) == 1 and "packed left out" in over[0].text


def test_auto_plans_packed_when_direct_and_staged_are_over_the_budget() -> None:
    """DeepSeek-V3 DCP4 -> DCP2 at 32k tokens, 2 layers: direct cuts every token (interleave 1) into
    one row per token and layer; packed folds them into a few strided steps."""
    pair, request = get_preset("deepseek-v3-dcp4-dcp2").build(32768, 0, layers=2, budget=None, strategy="direct")
    shape = RequestShape.of(request)
    direct = estimate_plan(pair, shape, "auto", staging_bytes=0)
    packed = estimate_plan(pair, shape, "packed")
    budget = PlanBudget(max_bytes=(direct.bytes + packed.bytes) // 2)
    assert budget.admits(packed) and not budget.admits(direct)
    plan = plan_pair(pair, request, strategy="auto", budget=budget)
    assert plan.packed and [n.kind.name for n in plan.notes].count("AUTO_OVER_BUDGET") == 1
    with pytest.raises(PlanBudgetExceeded):
        plan_pair(pair, request, strategy="auto", budget=PlanBudget(max_bytes=packed.bytes // 2))


def test_the_default_budget_admits_packed_presets_at_128k_tokens() -> None:
    for name in ("llama3-70b-tp8-tp4", "deepseek-v3-tp8-dcp8", "deepseek-v3-dcp4-dcp2", "kimi-linear-tp1-tp8"):
        preset = get_preset(name)
        prefill, decode = preset.geometries(131072, 0)
        pair = Pair(prefill, decode)
        shape = fresh_shape(pair, 131072, decode_tokens=preset.decode_tokens(131072))
        assert DEFAULT_BUDGET.admits(estimate_plan(pair, shape, "packed")), name


@settings(max_examples=100, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(kst.pairs(mismatch_probability=0.0, max_tokens=96))
def test_the_compile_estimate_bounds_the_compiled_patterns(gp: Any) -> None:
    """The rows a compile builds (every alignment class of a D page, both landings, every side cut at
    each kernel page) are at most what ``estimate_compile`` counts."""
    from kvgeom.planning.compile_step import _Source

    pair = Pair(gp.prefill, gp.decode)
    est = budget_module.estimate_compile(pair)
    compiled = pair.compile(budget=None)
    sources = list(compiled.direct.values()) + [s for s in compiled.staged.values() if isinstance(s, _Source)]
    assert est.copy_rows >= sum(p.raw for src in sources for p in src.interior)
    assert DEFAULT_BUDGET.admits(est)


def test_a_pair_too_costly_to_compile_stays_on_the_reference_path() -> None:
    """P pages of 1009 tokens, D pages of 1013 (HND -> NHD): a D page has 1009 alignment classes, so
    compiling builds the rows of 1,022,117 tokens (main ran 14 s into MemoryError on the pair's
    second 100-token plan). The compile is refused from its estimate; plan_pair stays on the
    reference path, whose plans are the same."""
    m = ModelSpec("m", [AttentionSpec("a", "full", 4, 8, 64)])
    pair = Pair(EngineGeometry.build(m, tp=1, kernel_block_tokens=1009, num_blocks=8, name="prefill"),
                EngineGeometry.build(m, tp=1, kernel_block_tokens=1013, num_blocks=8, layout="NHD", name="decode"))
    request = fresh_request(pair, 100)
    t0 = time.perf_counter()
    plans = [plan_pair(pair, request) for _ in range(3)]
    with pytest.raises(PlanBudgetExceeded, match="compile"):
        pair.compile()
    assert time.perf_counter() - t0 < 60  # a generous ceiling: compiling it takes minutes and gigabytes
    assert plans[0] == plans[2] == plan_reference(pair, request)
    assert not DEFAULT_BUDGET.admits(budget_module.estimate_compile(pair))


def test_fresh_shape_is_the_shape_of_fresh_request() -> None:
    for name in ("qwen-swa-tp2-tp4", "kimi-linear-tp8-tp1", "gqa-tp2-tp4"):
        preset = get_preset(name)
        pair, request = preset.build(600, 0)
        shape = fresh_shape(pair, 600, decode_tokens=preset.decode_tokens(600))
        assert [g for g, _ in zip(shape.groups, request.groups)] == list(RequestShape.of(
            fresh_request(pair, 600, decode_tokens=preset.decode_tokens(600))).groups)


def test_worked_number_whole_pages() -> None:
    """docs/design.md §14: TP1 -> TP1, HND, K = 16, 80 layers of 8 heads x 256 B, M = 16384: 1024 segments,
    the token, head and plane modes all fold (a whole 64 KiB page per row), so 1024 x 80 rows are
    estimated; the planner builds 80 (the consecutive pages of each layer collapse into one run)."""
    m = ModelSpec("m", [AttentionSpec("a", "full", 80, 8, 256)])
    e = EngineGeometry.build(m, tp=1, kernel_block_tokens=16, num_blocks=1024)
    pair = Pair(e.with_name("prefill"), e.with_name("decode"))
    request = fresh_request(pair, 16384)
    est = pair.estimate(request)
    assert (est.segments, est.copy_rows, est.zero_rows) == (1024, 1024 * 80, 0)
    assert pair.plan(request).copies_before_coalescing == 80


def test_a_plan_beyond_the_budget_is_refused_before_it_is_built() -> None:
    m = ModelSpec("m", [AttentionSpec("a", "full", 4, 8, 16)])
    P = EngineGeometry.build(m, tp=1, kernel_block_tokens=4, num_blocks=4096, layout="HND", name="prefill")
    D = EngineGeometry.build(m, tp=1, kernel_block_tokens=4, num_blocks=4096, layout="NHD", name="decode")
    request = fresh_request(Pair(P, D), 16384)
    est = estimate_plan(Pair(P, D), RequestShape.of(request), "direct")
    # HND -> NHD: one row per (token, head, plane, layer) = 16384 * 8 * 2 * 4
    assert est.copy_rows == 16384 * 8 * 2 * 4
    small = PlanBudget(max_bytes=est.bytes - 1)
    with pytest.raises(PlanBudgetExceeded) as info:
        plan_transfer(P, D, request, budget=small)
    err = info.value
    assert err.path == "plan" and err.actual == est and f"max_bytes <= {est.bytes - 1:,}" in str(err)
    assert "budget=PlanBudget(max_bytes=" in err.fix and "--budget-mb" in err.fix
    assert len(plan_transfer(P, D, request, budget=PlanBudget(max_bytes=est.bytes)).copies) > 0
    with pytest.raises(PlanBudgetExceeded):
        Pair(P, D).plan(request, budget=PlanBudget(max_steps=1))


def test_a_remote_claiming_absurd_tp_is_refused_in_constant_time() -> None:
    """Defect 2 of issue 11: a remote claiming tp = 2**40 is refused when its geometry is built (at most
    2**20 ranks); one claiming 2**20 ranks is refused by the estimate, from an O(groups) count before
    any loop over the ranks (the old planner looped over every one of them)."""
    m = ModelSpec("m", [AttentionSpec("a", "full", 1, 2**20, 16)])
    with pytest.raises(GeometryError, match="rank count"):
        EngineGeometry.build(m, tp=2**40, kernel_block_tokens=1, num_blocks=4, name="decode")
    P = EngineGeometry.build(m, tp=1, kernel_block_tokens=1, num_blocks=4, name="prefill")
    D = EngineGeometry.build(m, tp=2**20, kernel_block_tokens=1, num_blocks=4, name="decode")
    request = fresh_request(Pair(P, D), 4)
    t0 = time.perf_counter()
    with pytest.raises(PlanBudgetExceeded, match="planner steps"):
        plan_transfer(P, D, request)
    assert time.perf_counter() - t0 < 60  # a generous ceiling: the old planner looped 2**40 times


def test_default_budget_and_its_validation() -> None:
    assert (DEFAULT_BUDGET.max_bytes, DEFAULT_BUDGET.max_work, DEFAULT_BUDGET.max_steps) == (4 << 30, 1 << 28, 1 << 16)
    for bad in (0, -1, 1.5, None, 2**49):
        with pytest.raises(KvGeomError) as binfo:
            PlanBudget(max_bytes=bad)  # type: ignore[arg-type]
        assert binfo.value.path == "PlanBudget.max_bytes" and not isinstance(binfo.value, PlanBudgetExceeded)
    with pytest.raises(Exception) as info:
        plan_transfer(*_tiny(), budget="lots")  # type: ignore[arg-type]
    assert info.value.__class__.__name__ == "KvGeomError" and "budget" in str(info.value)


def _tiny() -> tuple[EngineGeometry, EngineGeometry, Request]:
    m = ModelSpec("m", [AttentionSpec("a", "full", 1, 2, 8)])
    P = EngineGeometry.build(m, tp=1, kernel_block_tokens=4, num_blocks=4, name="prefill")
    D = EngineGeometry.build(m, tp=1, kernel_block_tokens=4, num_blocks=4, name="decode")
    return P, D, fresh_request(Pair(P, D), 8)


def test_preset_build_checks_the_budget_before_building_the_request() -> None:
    """`kvgeom plan --tokens 100000000` used to build 6M-id block lists first; the shape is refused."""
    preset = get_preset("llama3-70b-tp8-tp4")
    t0 = time.perf_counter()
    with pytest.raises(PlanBudgetExceeded):
        preset.build(10**8, 0, layers=2)
    assert time.perf_counter() - t0 < 60
