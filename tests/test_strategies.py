"""kvgeom.tools.strategies: what the strategies draw, how they validate and shrink, and the property the
fuzzer runs at scale -- every drawn pair is rejected with the same reason pairable() gives, or
planned (direct, staged, auto) into a plan the simulator verifies with zero violations."""

from __future__ import annotations

import subprocess
import sys
from typing import Any

import pytest

hypothesis = pytest.importorskip("hypothesis", reason="kvgeom.tools.strategies needs the testing extra (hypothesis)")

from hypothesis import HealthCheck, Phase, find, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from hypothesis.errors import InvalidArgument  # noqa: E402

from kvgeom import (  # noqa: E402
    AttentionSpec,
    BlockList,
    EngineGeometry,
    IncompatibleGeometry,
    ModelSpec,
    Pair,
    StateGroupGeometry,
    StateSlots,
    StateSpec,
    pairable,
    plan_transfer,  # noqa: E402
    simulate,
)
from kvgeom.checking import listed_pages  # noqa: E402
from kvgeom.tools import strategies as kst  # noqa: E402

FAST = settings(max_examples=60, derandomize=True, deadline=None, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
PROPERTY = settings(FAST, max_examples=300)
FIND = settings(max_examples=2000, derandomize=True, database=None, deadline=None,
                suppress_health_check=list(HealthCheck))
REACH = settings(FIND, phases=[Phase.generate])  # any example will do: no shrinking


# ---- the property (the fuzzer's, at a CI budget) ------------------------------------------------------


@pytest.mark.parametrize("strategy", ["direct", "staged", "auto", "packed"])
def test_every_pair_is_rejected_consistently_or_planned_correctly(strategy: str) -> None:
    @PROPERTY
    @given(kst.transfers(pairs=kst.pairs(mismatch_probability=0.15)))
    def prop(t: kst.Transfer) -> None:
        p, d = t.pair
        compat = pairable(p, d)
        try:
            plan = plan_transfer(p, d, t.request, strategy=strategy)  # type: ignore[arg-type]
        except IncompatibleGeometry as e:
            assert not compat.ok, f"pairable() says ok, the planner refused: {e}"
            assert e.path == compat.reasons[0].path, (e.path, compat.reasons[0].path)
            return
        assert compat.ok, f"pairable() says {compat}, but the planner returned a plan"
        replan = plan_transfer(p, d, t.request, strategy=strategy)  # type: ignore[arg-type]
        report = simulate(Pair(p, d), t.request, plan, replan=replan)
        assert report.ok, str(report)

    prop()


def test_packed_plans_in_drawn_chunks_are_correct() -> None:
    """The property for the packed strategy at a drawn staging capacity: chunks by layers, token ranges
    and state sections, each a complete pack -> wire -> unpack unit (docs/design.md §12.3)."""

    @settings(FAST, max_examples=200)
    @given(kst.packed_transfers(transfers=kst.transfers(pairs=kst.pairs(mismatch_probability=0.0))))
    def prop(t: kst.PackedTransfer) -> None:
        p, d = t.pair
        # budget=None: a capacity of a few tokens makes many chunks, which the default budget's loose packed
        # estimate may refuse (PlanBudgetExceeded, typed); this property is about the plans themselves
        plan = plan_transfer(p, d, t.request, strategy="packed", staging_bytes=t.staging_bytes, budget=None)
        assert len(plan.wire) <= p.num_ranks * d.num_ranks * max(1, len(plan.chunks))
        assert int(plan.staging_used("prefill").max(initial=0)) <= t.staging_bytes
        assert int(plan.staging_used("decode").max(initial=0)) <= t.staging_bytes
        replan = plan_transfer(p, d, t.request, strategy="packed", staging_bytes=t.staging_bytes, budget=None)
        report = simulate(Pair(p, d), t.request, plan, replan=replan)
        assert report.ok, str(report)

    prop()


def test_packed_transfers_reach_several_chunks_and_token_ranges() -> None:
    def cut(t: kst.PackedTransfer) -> bool:
        plan = plan_transfer(*t.pair, t.request, strategy="packed", staging_bytes=t.staging_bytes)
        return any(piece.token_stop - piece.token_start < plan.chunks[0].pieces[0].token_stop
                   for c in plan.chunks[1:] for piece in c.pieces if piece.token_stop > piece.token_start) \
            and len(plan.chunks) >= 3

    found = find(kst.packed_transfers(transfers=kst.transfers(pairs=kst.pairs(mismatch_probability=0.0))), cut,
                 settings=REACH)
    assert found.staging_bytes >= 1


LAYOUT_CHANGES = kst.transfers(pairs=kst.pairs(models=kst.models(kinds=("full",), max_groups=1), kernel_tokens=(4, 8),
                                               max_blocks_per_logical=2, padding=False), max_tokens=24)


@pytest.mark.parametrize("strategy", ["staged", "auto"])
def test_layout_changes_inside_partial_blocks(strategy: str) -> None:
    """The same property, narrowed to one attention group whose layout (HND/NHD, K/V packed, split or
    inner) and kernel page differ between the sides, on requests that end inside a block: where the
    staged strategy's arrived layout and its zeros must agree with D's final layout."""

    @settings(FAST, max_examples=200)
    @given(LAYOUT_CHANGES)
    def prop(t: kst.Transfer) -> None:
        pair = Pair(*t.pair)
        plan = pair.plan(t.request, strategy=strategy)
        report = simulate(pair, t.request, plan)
        assert report.ok, str(report)

    prop()


@FAST
@given(kst.unpairable_pairs())
def test_unpairable_pairs_are_rejected_by_pairable_and_by_pair(gp: kst.DrawnPair) -> None:
    compat = pairable(*gp)
    assert not compat.ok
    with pytest.raises(IncompatibleGeometry) as err:
        Pair(*gp)
    assert err.value.path == compat.reasons[0].path


# ---- what the strategies draw ---------------------------------------------------------------------------


@FAST
@given(kst.transfers())
def test_drawn_requests_fit_their_pair(t: kst.Transfer) -> None:
    pair = Pair(*t.pair)
    req = t.request
    pair.check_request(req)  # ids inside the pools, first tokens on block boundaries
    listed_pages(pair.prefill, req, "prefill")  # groups sharing a region never share a block
    listed_pages(pair.decode, req, "decode")
    M, S = req.computed_tokens, req.prefix_hit_tokens
    Bp, Bd = pair.prefill.logical_block_tokens, pair.decode.logical_block_tokens
    assert 1 <= M <= 64 and S % Bd == 0 and S <= M
    for spec, g in zip(pair.model.groups, req.groups):
        if isinstance(spec, AttentionSpec):
            assert isinstance(g.prefill, BlockList) and isinstance(g.decode, BlockList)
            p0, p1 = g.prefill.token_range(Bp)
            d0, d1 = g.decode.token_range(Bd)
            assert p0 <= max(S, (M - (spec.window_tokens or M)) // Bp * Bp)  # P starts at or before what D needs
            assert p1 >= M and d1 >= M  # both cover the computed tokens
        else:
            assert isinstance(g.prefill, StateSlots) and isinstance(g.decode, StateSlots)
            assert g.prefill.tokens[-1] == M and g.decode.tokens[-1] == M  # the running state
            assert all(t <= M for t in g.prefill.tokens)


@FAST
@given(kst.pairs())
def test_pairs_share_a_model_and_shard_every_axis(gp: kst.DrawnPair) -> None:
    assert gp.prefill.model == gp.decode.model
    assert (gp.prefill.name, gp.decode.name) == ("prefill", "decode")
    for e in gp:
        for spec in e.model.groups:
            axes = [(spec.num_kv_heads, spec.replicated)] if isinstance(spec, AttentionSpec) else \
                [(s.channels, s.replicated) for s in spec.sections]
            for n, rep in axes:
                assert rep or n % e.tp == 0 or e.tp % n == 0
        if any(isinstance(s, StateSpec) for s in e.model.groups):
            # a hybrid: shared regions, and every layer's state fits one logical page
            for gi, spec in enumerate(e.model.groups):
                if isinstance(spec, StateSpec):
                    geo = e.groups[gi]
                    assert isinstance(geo, StateGroupGeometry)
                    for v in geo.views:
                        assert v.offset + e.state_bytes(gi) <= e.logical_page_bytes(v.region)


def _find(strategy: Any, condition: Any, how: settings = FIND) -> Any:
    return find(strategy, condition, settings=how)


def test_features_are_reachable() -> None:
    """Each feature the brief asks for is drawn by some example (found by search, not by luck)."""

    def sliding_tails_differ(t: kst.Transfer) -> bool:
        return any(isinstance(s, AttentionSpec) and s.window_tokens is not None
                   and g.prefill.first_token != g.decode.first_token  # type: ignore[union-attr]
                   for s, g in zip(t.pair.prefill.model.groups, t.request.groups))

    def scattered(t: kst.Transfer) -> bool:
        ids = [b for g in t.request.groups if isinstance(g.decode, BlockList) for b in g.decode.block_ids]
        return len(ids) >= 3 and ids != sorted(ids)

    def paired_extra_state(t: kst.Transfer) -> bool:
        return any(isinstance(g.decode, StateSlots) and isinstance(g.prefill, StateSlots)
                   and len(set(g.decode.tokens) & set(g.prefill.tokens)) >= 2 for g in t.request.groups)

    def prefix_with_earlier_listing(t: kst.Transfer) -> bool:
        S = t.request.prefix_hit_tokens
        return S > 0 and any(isinstance(g.decode, BlockList) and g.decode.first_token < S for g in t.request.groups)

    def gqa_replicas(p: kst.DrawnPair) -> bool:
        return any(isinstance(s, AttentionSpec) and s.kind.value == "full" and p.decode.tp > s.num_kv_heads
                   for s in p.decode.model.groups)

    for condition in (sliding_tails_differ, scattered, paired_extra_state, prefix_with_earlier_listing):
        _find(kst.transfers(), condition, REACH)
    _find(kst.pairs(), lambda p: p.prefill.tp > p.decode.tp > 1, REACH)
    _find(kst.pairs(), gqa_replicas, REACH)
    _find(kst.pairs(), lambda p: p.prefill.groups[0].views[0].offset > 0, REACH)  # padded views
    _find(kst.pairs(), lambda p: any(isinstance(s, StateSpec) for s in p.prefill.model.groups)
          and len(p.prefill.model.groups) > 1, REACH)  # hybrids


def test_failures_shrink_to_small_geometries() -> None:
    """The smallest pair with a TP mismatch: one full-attention group, 1 layer, 1 head of 1 byte,
    P TP1 and D TP2, the first kernel size, ppl 1, HND packed, one region per layer."""
    gp = _find(kst.pairs(), lambda p: p.decode.tp != p.prefill.tp)
    (spec,) = gp.prefill.model.groups
    assert isinstance(spec, AttentionSpec)
    assert (spec.kind.value, spec.num_layers, spec.num_kv_heads, spec.head_bytes) == ("full", 1, 1, 1)
    assert sorted([gp.prefill.tp, gp.decode.tp]) == [1, 2]
    for e in gp:
        assert (e.kernel_block_tokens, e.blocks_per_logical, len(e.regions)) == (4, 1, 1)
    t = _find(kst.transfers(), lambda t: t.request.prefix_hit_tokens > 0)
    # the smallest prefix hit is one D block, on a request of exactly that many tokens
    assert t.request.prefix_hit_tokens == t.pair.decode.logical_block_tokens == t.request.computed_tokens


# ---- construction-time validation --------------------------------------------------------------------------


M1 = ModelSpec("m", [AttentionSpec("a", "full", 1, 4, 8)])


@pytest.mark.parametrize(("make", "words"), [
    (lambda: kst.models(max_layers=0), "max_layers=0"),
    (lambda: kst.models(kinds=("full", "cross")), "'cross'"),
    (lambda: kst.models(kinds=()), "kinds=()"),
    (lambda: kst.models(min_groups=3, max_groups=2), "min_groups=3 must be <= max_groups=2"),
    (lambda: kst.engines(M1, max_tp=0), "max_tp=0"),
    (lambda: kst.engines(M1, kernel_tokens=(4, 4)), "kernel_tokens=(4, 4)"),
    (lambda: kst.engines(M1, kv=("split",), regions=("shared",)), "shared regions need K/V in one page"),
    (lambda: kst.engines("llama"), "model='llama'"),  # type: ignore[arg-type]
    (lambda: kst.pairs(mismatch_probability=1.5), "mismatch_probability=1.5"),
    (lambda: kst.unpairable_pairs(mismatches=("colour",)), "'colour'"),
    (lambda: kst.transfers(min_tokens=9, max_tokens=8), "min_tokens=9 must be <= max_tokens=8"),
])
def test_bad_arguments_raise_at_construction(make: Any, words: str) -> None:
    with pytest.raises(InvalidArgument) as err:
        make()  # eager: no .example() needed
    assert words in str(err.value)


def test_requests_for_a_too_small_pool_name_the_limit() -> None:
    # one full group, B = 4 tokens, 5 blocks: the longest request of M tokens lists ceil(M/4) + 1 blocks,
    # so M <= 16 fits and M = 17 (6 blocks) does not
    e = EngineGeometry.build(M1, tp=1, kernel_block_tokens=4, num_blocks=5)
    gp = kst.DrawnPair(e.with_name("prefill"), e.with_name("decode"))
    kst.requests(gp, max_tokens=16)
    with pytest.raises(InvalidArgument) as err:
        kst.requests(gp, max_tokens=17)
    assert "max_tokens=17" in str(err.value) and "max_tokens <= 16" in str(err.value)
    with pytest.raises(InvalidArgument):
        kst.requests(object())


@FAST
@given(st.data())
def test_requests_default_max_tokens_follows_the_pool(data: st.DataObject) -> None:
    e = EngineGeometry.build(M1, tp=1, kernel_block_tokens=4, num_blocks=5)
    req = data.draw(kst.requests(kst.DrawnPair(e, e)))
    assert req.computed_tokens <= 16


def test_importing_kvgeom_does_not_import_hypothesis_or_matplotlib() -> None:
    code = ("import sys, kvgeom, kvgeom.tools.cli, kvgeom.checking; "
            "bad = [m for m in ('hypothesis', 'matplotlib', 'torch', 'nixl') if m in sys.modules]; "
            "print(bad); sys.exit(1 if bad else 0)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr


def test_the_module_docstring_example_runs() -> None:
    """Issue 20 (8): the docstring said ``from kvgeom import strategies``, which fails; its example
    now runs as written, with kvgeom's own planner standing in for the connector's."""
    import textwrap

    from hypothesis import settings

    import kvgeom.tools.strategies as module
    from kvgeom import plan_transfer

    doc = module.__doc__ or ""
    code = textwrap.dedent(doc.split("::\n\n", 1)[1].split("\nDraw order", 1)[0])
    scope: dict[str, object] = {"my_connector_plan": plan_transfer}
    exec(compile(code, module.__file__ or "strategies", "exec"), scope)  # our own docstring
    settings(max_examples=10, deadline=None, derandomize=True, database=None)(scope["test_my_connector"])()
