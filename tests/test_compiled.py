"""The compiled pair plans exactly what the reference planner plans (docs/design.md §13).

``CompiledPair.plan`` and ``plan_reference`` must agree on every column, every rearrange, every
note and both counts before coalescing, for every strategy (auto under several cost models and
staging capacities) and every topology the strategies draw, and must refuse the same requests with
the same error. The reference path is the definition. Packed plans (asked for, or auto's choice)
come from the reference planner on both paths; the compiled one adds a ``REFERENCE_PATH`` note.
"""

from __future__ import annotations

from typing import Any

import attrs
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvgeom import (
    BlockList,
    CompiledPair,
    CostModel,
    GroupRequest,
    KvGeomError,
    NoteKind,
    Pair,
    Request,
    StateSlots,
    TransferPlan,
    fresh_request,
    plan_reference,
    simulate,
    tile_bytes,
)
from kvgeom.building import PRESETS, get_preset
from kvgeom.lowering import TileTable, tile_index_blocks, tile_index_pairs, tile_table
from kvgeom.tools import strategies as kst
from kvgeom.values import CopyBlock, blocks_to_copies

STRATEGIES = ("direct", "staged", "auto", "packed")
SETTINGS = dict(deadline=None, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


def assert_same(got: TransferPlan, want: TransferPlan) -> None:
    for name in ("p_rank", "p_region", "p_offset", "d_rank", "d_region", "d_offset", "nbytes"):
        np.testing.assert_array_equal(getattr(got.copies, name), getattr(want.copies, name), err_msg=f"copies.{name}")
    for name in ("d_rank", "d_region", "d_offset", "nbytes"):
        np.testing.assert_array_equal(getattr(got.zeros, name), getattr(want.zeros, name), err_msg=f"zeros.{name}")
    assert got.rearranges == want.rearranges
    assert (got.packs, got.unpacks, got.wire, got.chunks, got.staging_bytes) == \
        (want.packs, want.unpacks, want.wire, want.chunks, want.staging_bytes)
    packed = want.notes[0].text == "strategy packed" or any(n.kind is NoteKind.AUTO_PACKED for n in want.notes)
    if packed:  # planned on the reference path, and noted
        assert got.notes[:-1] == want.notes and got.notes[-1].kind is NoteKind.REFERENCE_PATH
    else:
        assert got.notes == want.notes
    assert got.copies_before_coalescing == want.copies_before_coalescing
    assert got.zeros_before_coalescing == want.zeros_before_coalescing
    assert (got.prefill_tp, got.decode_tp, got.prefill_ranks, got.decode_ranks) == \
        (want.prefill_tp, want.decode_tp, want.prefill_ranks, want.decode_ranks)


def same_or_same_error(pair: Pair, compiled: CompiledPair, request: Request, **kw: Any) -> None:
    try:
        want = plan_reference(pair, request, **kw)
    except KvGeomError as e:
        with pytest.raises(type(e)) as got:
            compiled.plan(request, **kw)
        assert str(got.value) == str(e)
        return
    assert_same(compiled.plan(request, **kw), want)


def check_all(pair: Pair, compiled: CompiledPair, request: Request) -> None:
    for strategy in STRATEGIES:
        same_or_same_error(pair, compiled, request, strategy=strategy)


@settings(max_examples=300, **SETTINGS)  # type: ignore[arg-type]
@given(kst.transfers())
def test_compiled_plans_equal_the_reference_over_drawn_transfers(t: Any) -> None:
    pair = Pair(*t.pair)
    check_all(pair, pair.compile(), t.request)


@settings(max_examples=80, **SETTINGS)  # type: ignore[arg-type]
@given(kst.transfers(pairs=kst.pairs(topology_probability=1.0)))
def test_compiled_plans_equal_the_reference_on_topologies(t: Any) -> None:
    pair = Pair(*t.pair)
    check_all(pair, pair.compile(), t.request)


# auto under cost models that pick each of direct, staged and packed, with posted counts exact
# (coalesced per group) or estimated (rows before coalescing), and no staging at all
COST_MODELS = (CostModel(), CostModel(exact_rows=0), CostModel(descriptor_seconds=1e-3, exact_rows=1 << 30),
               CostModel(rearrange_bytes_per_second=1e15, op_seconds=1.0, exact_rows=16),
               CostModel(packed_setup_seconds=1.0))  # (a packed transfer's fixed cost: packed loses)


@settings(max_examples=100, **SETTINGS)  # type: ignore[arg-type]
@given(kst.packed_transfers(), st.sampled_from(COST_MODELS), st.booleans())
def test_auto_and_packed_weigh_and_plan_the_same(t: Any, cost_model: CostModel, staging: bool) -> None:
    pair = Pair(*t.pair)
    compiled = pair.compile()
    staging_bytes = t.staging_bytes if staging else 0
    same_or_same_error(pair, compiled, t.request, strategy="auto", cost_model=cost_model, staging_bytes=staging_bytes)
    same_or_same_error(pair, compiled, t.request, strategy="packed", staging_bytes=staging_bytes)


@settings(max_examples=60, **SETTINGS)  # type: ignore[arg-type]
@given(kst.transfers(), st.data())
def test_one_compiled_pair_plans_many_requests(t: Any, data: Any) -> None:
    # the same compiled pair (its caches of partial pages warm) plans other requests of the pair
    pair = Pair(*t.pair)
    compiled = pair.compile()
    check_all(pair, compiled, t.request)
    for _ in range(3):
        check_all(pair, compiled, data.draw(kst.requests(t.pair)))


def _mutations(request: Request, pair: Pair, draw: Any) -> Request:
    """One change that may make the request invalid (or keep it valid: both paths must agree)."""
    groups = list(request.groups)
    gi = draw(st.integers(0, len(groups) - 1))
    side = draw(st.sampled_from(("prefill", "decode")))
    listing = getattr(groups[gi], side)
    how = draw(st.sampled_from(("drop_last", "drop_first", "shift_first", "huge_id", "prefix", "tokens")))
    if isinstance(listing, BlockList):
        ids, first = list(listing.block_ids), listing.first_token
        if how == "drop_last" and ids:
            ids = ids[:-1]
        elif how == "drop_first" and ids:
            ids, first = ids[1:], first + pair.side(side).logical_block_tokens
        elif how == "shift_first":
            first += draw(st.integers(1, 3))
        elif how == "huge_id" and ids:
            ids[-1] = max(ids) + 10_000
        new: Any = BlockList(tuple(ids), first)
    else:
        slots, tokens = list(listing.slot_ids), list(listing.tokens)
        if how == "tokens" and tokens:
            tokens[-1] += draw(st.integers(1, 3))
        elif how == "huge_id" and slots:
            slots[-1] = max(slots) + 10_000
        new = StateSlots(tuple(slots), tuple(tokens))
    groups[gi] = GroupRequest(new, groups[gi].decode) if side == "prefill" else GroupRequest(groups[gi].prefill, new)
    S = request.prefix_hit_tokens + (draw(st.integers(1, 3)) if how == "prefix" else 0)
    return Request(request.computed_tokens, tuple(groups), min(S, request.computed_tokens),
                   partial=request.partial and draw(st.booleans()))


@settings(max_examples=150, **SETTINGS)  # type: ignore[arg-type]
@given(kst.transfers(), st.data())
def test_compiled_pair_refuses_what_the_reference_refuses(t: Any, data: Any) -> None:
    pair = Pair(*t.pair)
    compiled = pair.compile()
    try:
        request = _mutations(t.request, pair, data.draw)
    except KvGeomError:
        return  # the request itself cannot be built (duplicate ids, two slots at one position)
    try:
        want = plan_reference(pair, request)
    except KvGeomError as e:
        with pytest.raises(type(e)) as got:
            compiled.plan(request)
        assert str(got.value) == str(e)
        return
    assert_same(compiled.plan(request), want)


@pytest.mark.parametrize("name", sorted(n for n, p in PRESETS.items() if p.pairable))
def test_presets_fresh_scattered_and_prefix_hits(name: str) -> None:
    preset = get_preset(name)
    layers = max(preset.min_layers, 2)
    rng = np.random.default_rng(7)
    pair, request = preset.build(tokens=3000, layers=layers)
    compiled = pair.compile()
    check_all(pair, compiled, request)
    # the same shape on scattered ids (every id renamed through one permutation per side)
    for side_pool in range(2):
        groups = []
        perms = {}
        for side in ("prefill", "decode"):
            eng = pair.side(side)
            pool = min(eng.num_logical_blocks(r) for r in range(len(eng.regions)))
            perms[side] = rng.permutation(pool)
        for g in request.groups:
            sides = {}
            for side in ("prefill", "decode"):
                listing = getattr(g, side)
                if isinstance(listing, BlockList):
                    sides[side] = BlockList(tuple(int(perms[side][b]) for b in listing.block_ids), listing.first_token)
                else:
                    sides[side] = StateSlots(tuple(int(perms[side][b]) for b in listing.slot_ids), listing.tokens)
            groups.append(GroupRequest(sides["prefill"], sides["decode"]))
        scattered = Request(request.computed_tokens, tuple(groups), request.prefix_hit_tokens)
        check_all(pair, compiled, scattered)
        assert simulate(pair, scattered, compiled.plan(scattered)).ok, side_pool
    # a prefix hit of one decode block and a 1-token request
    B = pair.decode.logical_block_tokens
    if 2 * B < 3000:
        hit = fresh_request(pair, 3000, prefix_hit_tokens=B, decode_tokens=preset.decode_tokens(3000))
        check_all(pair, compiled, hit)
    check_all(pair, compiled, fresh_request(pair, 1, decode_tokens=preset.decode_tokens(1)))


def test_pair_compiles_once_and_plans_the_same() -> None:
    pair, request = get_preset("llama3-70b-tp8-tp4").build(tokens=100)
    first = pair.plan(request)  # one request: the reference path
    compiled = pair.compile()
    assert pair.compile() is compiled
    assert_same(pair.plan(request), first)
    assert_same(compiled.plan(request), first)
    # equal pairs compile separately, and the compiled form is not part of a pair's value
    other = Pair(pair.prefill, pair.decode)
    assert other == pair and hash(other) == hash(pair)


def test_compiled_structure_worked_numbers() -> None:
    # Llama-3-70B-like TP8 -> TP4, 80 layers in one region each, HND K/V packed, 16-token pages:
    # D rank d reads heads 2d, 2d+1 from P ranks 2d, 2d+1 (one head each): 4 D ranks x 2 P ranks x
    # 80 layers = 640 streams, all the same page pattern shifted by a head (4096 B on D): one family;
    # per stream and page 2 pieces (K and V of one head, 16 * 256 = 4096 B each)
    pair, request = get_preset("llama3-70b-tp8-tp4").build(tokens=16384)
    stats = pair.compile().stats()
    attn = stats["attn"]
    assert (attn.streams, attn.families, attn.classes, attn.pieces_per_page) == (640, 1, 1, 2 * 640)
    plan = pair.compile().plan(request)
    assert len(plan.copies) == 640 * 2 * (16384 // 16)  # nothing merges: 1,310,720 rows
    assert attrs.asdict(attn)["zero_streams"] == 4 * 80  # zeros: every D rank's 80 layer regions


@settings(max_examples=120, **SETTINGS)  # type: ignore[arg-type]
@given(kst.transfers())
def test_rank_plans_and_blocks_are_the_whole_plans_projections(t: Any) -> None:
    pair = Pair(*t.pair)
    compiled = pair.compile()
    for strategy in STRATEGIES:
        full = plan_reference(pair, t.request, strategy=strategy)
        for d in range(pair.decode.num_ranks):
            mine = compiled.plan(t.request, strategy=strategy, decode_rank=d)
            assert_same(mine, full.for_decode_rank(d))
            assert blocks_to_copies(compiled.copy_blocks(t.request, strategy=strategy, decode_rank=d)) == mine.copies
        for p in range(pair.prefill.num_ranks):
            mine = compiled.plan(t.request, strategy=strategy, prefill_rank=p)
            assert_same(mine, full.packed_for_prefill_rank(p))
            assert mine.copies == full.for_prefill_rank(p)
            assert not len(mine.zeros) and not mine.rearranges and not mine.unpacks
            assert blocks_to_copies(compiled.copy_blocks(t.request, strategy=strategy, prefill_rank=p)) == mine.copies
    assert blocks_to_copies(compiled.copy_blocks(t.request)) == plan_reference(pair, t.request).copies


def test_projecting_a_plan_onto_the_one_rank_it_holds_returns_it() -> None:
    """A rank plan (or any plan of one D rank) projected onto its own rank is the same immutable plan,
    not a re-checked copy; onto another rank it is still that rank's (here: nothing)."""
    pair, request = get_preset("llama3-70b-tp8-tp4").build(tokens=64)
    mine = pair.compile().plan(request, decode_rank=1)
    assert len(mine.copies) and set(mine.copies.d_rank.tolist()) == {1}
    assert mine.for_decode_rank(1) is mine
    other = mine.for_decode_rank(0)
    assert other is not mine and not len(other.copies) and not len(other.zeros) and not other.rearranges
    whole = pair.compile().plan(request)
    assert whole.for_decode_rank(1) is not whole and whole.for_decode_rank(1).copies == mine.copies


@settings(max_examples=80, **SETTINGS)  # type: ignore[arg-type]
@given(kst.transfers())
def test_tile_indices_from_blocks_equal_those_from_columns(t: Any) -> None:
    pair = Pair(*t.pair)
    compiled = pair.compile()
    tile = tile_bytes(pair)
    plan = plan_reference(pair, t.request)
    P, D = pair.prefill, pair.decode
    for d in range(D.num_ranks):
        got = tile_index_blocks(compiled.copy_blocks(t.request, decode_rank=d), tile,
                                p_tables=lambda r: tile_table(P, tile, r), d_tables=lambda r: tile_table(D, tile, r))
        mine = plan.for_decode_rank(d).copies
        assert set(got) == {(int(p), d) for p in np.unique(mine.p_rank)}
        for (p, _), (p_idx, d_idx) in got.items():
            want = tile_index_pairs(mine.take(mine.p_rank == p), tile, p_table=tile_table(P, tile, p),
                                    d_table=tile_table(D, tile, d))
            np.testing.assert_array_equal(p_idx, want[0])
            np.testing.assert_array_equal(d_idx, want[1])


def test_tile_index_blocks_worked_number_and_bounds() -> None:
    # 2 streams x 3 rows of one 1024-byte tile: D offsets base [0, 4096, 8192] + shift [0, 1024] in
    # region 0 (first entry 0): D indices [0, 4, 8] then [1, 5, 9]; P likewise from region 1,
    # whose first entry is 16 (region 0 has 16 tiles)
    one = np.ones(2, np.int64)
    block = CopyBlock(0 * one, one, np.array([0, 1024]), 0 * one, 0 * one, np.array([0, 1024]),
                      np.array([0, 4096, 8192]), np.array([0, 4096, 8192]), np.array([1024, 1024, 1024]))
    table = TileTable(1024, (16 * 1024, 16 * 1024))
    got = tile_index_blocks([block], 1024, p_tables={0: table}, d_tables={0: table})
    assert got[(0, 0)][1].tolist() == [0, 4, 8, 1, 5, 9]
    assert got[(0, 0)][0].tolist() == [16, 20, 24, 17, 21, 25]
    small = TileTable(1024, (8 * 1024,))  # D region 0 of 8 tiles: the 8192-byte row of stream 1 ends at 10240
    with pytest.raises(KvGeomError, match="region 0"):
        tile_index_blocks([block], 1024, p_tables={0: table}, d_tables={0: small})


@pytest.mark.parametrize("knob", ["flat", "families", "insert"])
def test_every_engine_path_plans_the_same(knob: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The compiled planner picks between expanding streams one pass (flat) and by families, and
    merges shared streams by sorting or by insertion, on sizes; force each choice on the presets
    (hybrid overlays included) and on drawn transfers."""
    from kvgeom.planning import assembly
    from kvgeom.planning import compiled_request as engine

    if knob == "flat":
        monkeypatch.setattr(engine, "FAMILY_LIMIT", 0)
        monkeypatch.setattr(engine, "FLAT_ROWS", 1 << 62)
    elif knob == "families":
        monkeypatch.setattr(engine, "FAMILY_LIMIT", 1 << 30)
    else:
        monkeypatch.setattr(assembly, "MERGE_ROWS", 0)
    for name in ("nemotron-h-tp1-tp4", "qwen3-next-tp2-tp4", "kimi-linear-tp8-tp1", "deepseek-v3-tp8-dcp8",
                 "qwen-swa-tp2-tp4", "llama3-70b-pp2tp4-tp8"):
        preset = get_preset(name)
        pair, request = preset.build(tokens=2000, layers=max(preset.min_layers, 1))
        check_all(pair, pair.compile(), request)
        check_all(pair, pair.compile(), fresh_request(pair, 1, decode_tokens=preset.decode_tokens(1)))

    @settings(max_examples=40, **SETTINGS)  # type: ignore[arg-type]
    @given(kst.transfers())
    def drawn(t: Any) -> None:
        pair = Pair(*t.pair)
        check_all(pair, pair.compile(), t.request)

    drawn()


def test_rearrange_with_pages_equals_evolve() -> None:
    # the worked number of Rearrange (NHD -> HND, 2 heads x 4 tokens of 8 B) on other pages: the
    # compiled path copies its checked templates instead of building each rearrange again
    from kvgeom.values import Rearrange

    r = Rearrange(0, 1, (3,), (2, 4), (8, 16), (32, 8), 8, page_bytes=64)
    moved = r.with_pages((5, 7))
    assert moved == attrs.evolve(r, pages=(5, 7)) and hash(moved) == hash(attrs.evolve(r, pages=(5, 7)))
    assert r.pages == (3,) and moved.nbytes_per_page == 64
