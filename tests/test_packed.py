"""The packed strategy (docs/design.md §12): hand-built packed plans the simulator passes, one wrong
plan per staging violation kind, the planner's plans against arithmetic, chunks and capacity.

Geometry used by the hand-built cases (``PAIR``): one full-attention layer of 2 KV heads of 8 B,
TP1 -> TP1, kernel pages of K = 4 tokens, one region, K/V packed. P is NHD, D is HND::

    P page [kv][token][head][8 B]: 2 * 4 * 2 * 8 = 128 B, kv_stride 64, token_stride 16, head_stride 8
    D page [kv][head][token][8 B]: 128 B,                 kv_stride 64, head_stride 32, token_stride 8

The request moves tokens [0, 8): P pages 5 (tokens 0..3) and 2 (4..7), D pages 1 and 3. Staging is
D's page order, so D's slot is [page 1's 128 B][page 3's 128 B] and the unpack is one 128-byte
element per page; the pack gathers 8-byte head vectors (P's head stride 8 is not staging's 32).
"""

from __future__ import annotations

from typing import Any

import attrs
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings

from kvgeom import (
    AttentionSpec,
    BlockList,
    Copies,
    EngineGeometry,
    GroupRequest,
    ModelSpec,
    NoteKind,
    Pair,
    PlanError,
    Request,
    TransferPlan,
    ViolationKind,
    Zeros,
    fresh_request,
    simulate,
)
from kvgeom.building import get_preset
from kvgeom.errors import StagingCapacityError
from kvgeom.planning import min_staging_bytes
from kvgeom.tools import strategies as kst
from kvgeom.values import Chunk, ChunkPiece, StagingStep, WireCopies

MODEL = ModelSpec("m", [AttentionSpec("attn", "full", 1, 2, 8)])
P_ENGINE = EngineGeometry.build(MODEL, tp=1, kernel_block_tokens=4, num_blocks=8, layout="NHD", name="prefill")
D_ENGINE = EngineGeometry.build(MODEL, tp=1, kernel_block_tokens=4, num_blocks=8, layout="HND", name="decode")
PAIR = Pair(P_ENGINE, D_ENGINE)
REQUEST = Request(8, [GroupRequest(BlockList([5, 2]), BlockList([1, 3]))])
SLOT = 1024


def step(side: str, pages: list[int], page_staged: list[int], *, shape: tuple[int, ...] = (),
         cache: tuple[int, ...] = (), staging: tuple[int, ...] = (), unit: int = 128, chunk: int = 0,
         staged: int = 0) -> StagingStep:
    return StagingStep(side, chunk, 0, 0, [0], [0], [staged], pages, page_staged, 128, shape, cache, staging, unit)


PACK = step("prefill", [5, 2], [0, 128], shape=(2, 2, 4), cache=(64, 8, 16), staging=(64, 32, 8), unit=8)
UNPACK = step("decode", [1, 3], [0, 128])
WIRE = WireCopies([0], [0], [0], [0], [0], [256])
CHUNKS = (Chunk(0, [ChunkPiece(0, 0, 1, 0, 8)]),)


def packed(packs: tuple[StagingStep, ...] = (PACK,), unpacks: tuple[StagingStep, ...] = (UNPACK,),
           wire: WireCopies = WIRE, chunks: tuple[Chunk, ...] = CHUNKS, copies: Copies | None = None) -> TransferPlan:
    return TransferPlan(1, 1, copies if copies is not None else Copies.empty(), Zeros.empty(), packs=packs,
                        unpacks=unpacks, wire=wire, chunks=chunks, staging_bytes=SLOT)


def kinds(plan: TransferPlan, replan: TransferPlan | None = None) -> dict[ViolationKind, int]:
    return dict(simulate(PAIR, REQUEST, plan, replan=replan).counts)


def test_the_hand_built_packed_plan_passes() -> None:
    assert simulate(PAIR, REQUEST, packed()).ok


def test_the_planner_builds_the_hand_built_plan() -> None:
    plan = PAIR.plan(REQUEST, strategy="packed", staging_bytes=SLOT)
    assert plan.packs == (PACK,) and plan.unpacks == (UNPACK,) and plan.wire == WIRE
    assert plan.chunks == CHUNKS and plan.staging_bytes == SLOT and len(plan.copies) == 0
    assert [n.kind for n in plan.notes] == [NoteKind.STRATEGY, NoteKind.PACKED, NoteKind.CHUNKS]


def test_a_wire_row_reading_bytes_no_pack_wrote_is_stale_staging() -> None:
    half = step("prefill", [5], [0], shape=(2, 2, 4), cache=(64, 8, 16), staging=(64, 32, 8), unit=8)
    got = kinds(packed(packs=(half,)))
    assert got[ViolationKind.STALE_STAGING] == 1  # the wire row reads [128, 256) of P's slot
    assert got[ViolationKind.WRONG_DATA] >= 1  # D page 3 receives the slot's stale pattern


def test_an_unpack_reading_bytes_no_wire_row_wrote_is_stale_staging() -> None:
    short = WireCopies([0], [0], [0], [0], [0], [128])
    assert kinds(packed(wire=short))[ViolationKind.STALE_STAGING] == 1  # D's slot bytes [128, 256) never written


def test_an_unpack_of_the_wrong_chunk_is_stale_staging() -> None:
    late = attrs.evolve(UNPACK, chunk=1)
    two = CHUNKS + (Chunk(1, []),)
    got = kinds(packed(unpacks=(late,), chunks=two))
    assert got[ViolationKind.STALE_STAGING] == 1 and got[ViolationKind.WRONG_DATA] >= 1  # the slot's own pattern


def test_two_packs_of_one_byte_are_staging_overlap() -> None:
    got = kinds(packed(packs=(PACK, PACK)))
    assert got == {ViolationKind.STAGING_OVERLAP: 2 * 2 * 2 * 4}  # 2 pages x (2 x 2 x 4) elements; content is right


def test_two_wire_rows_into_one_slot_byte_are_staging_overlap() -> None:
    twice = WireCopies([0, 0], [0, 0], [0, 0], [0, 0], [0, 0], [256, 256])
    assert kinds(packed(wire=twice))[ViolationKind.STAGING_OVERLAP] == 1


@pytest.mark.parametrize("what", ["wire past the slot", "wire of a missing chunk", "pack of a missing chunk",
                                  "unpack past the slot"])
def test_staging_outside_the_slot_is_staging_out_of_slot(what: str) -> None:
    plan = {
        "wire past the slot": packed(wire=WireCopies([0], [0], [0], [0], [SLOT - 128], [256])),
        "wire of a missing chunk": packed(wire=WireCopies([1], [0], [0], [0], [0], [256])),
        "pack of a missing chunk": packed(packs=(attrs.evolve(PACK, chunk=3),)),
        "unpack past the slot": packed(unpacks=(step("decode", [1, 3], [0, SLOT - 64]),)),
    }[what]
    assert kinds(plan)[ViolationKind.STAGING_OUT_OF_SLOT] == 1


def test_a_pack_reading_an_unlisted_p_page_is_foreign_read() -> None:
    other = attrs.evolve(PACK, pages=[5, 6])  # P lists blocks 5 and 2
    got = kinds(packed(packs=(other,)))
    assert got[ViolationKind.FOREIGN_READ] == 1 and got[ViolationKind.WRONG_DATA] >= 1


def test_an_unpack_into_an_unlisted_d_page_is_foreign_write() -> None:
    other = attrs.evolve(UNPACK, pages=[1, 4])  # D lists blocks 1 and 3
    got = kinds(packed(unpacks=(other,)))
    assert got[ViolationKind.FOREIGN_WRITE] == 1 and got[ViolationKind.CLOBBERED] >= 1


def test_two_unpacks_of_one_d_byte_are_overlapping_write() -> None:
    assert kinds(packed(unpacks=(UNPACK, UNPACK))) == {ViolationKind.OVERLAPPING_WRITE: 2}


def test_an_unpack_over_a_copy_is_overlapping_write() -> None:
    copy = Copies([0], [0], [5 * 128], [0], [0], [1 * 128], [8])
    assert kinds(packed(copies=copy))[ViolationKind.OVERLAPPING_WRITE] == 1


def test_pages_unpacked_in_the_wrong_order_are_wrong_data() -> None:
    swapped = attrs.evolve(UNPACK, page_staged=[128, 0])
    assert set(kinds(packed(unpacks=(swapped,)))) == {ViolationKind.WRONG_DATA}


def test_a_wire_row_split_in_mergeable_halves_is_not_minimal() -> None:
    halves = WireCopies([0, 0], [0, 0], [0, 128], [0, 0], [0, 128], [128, 128])
    assert kinds(packed(wire=halves)) == {ViolationKind.NOT_MINIMAL: 1}


def test_a_different_replan_is_nondeterministic() -> None:
    other = packed(packs=(attrs.evolve(PACK, pages=[5, 2]),), wire=WireCopies([0], [0], [0], [0], [0], [256]))
    assert kinds(packed(), replan=other) == {}
    assert kinds(packed(), replan=packed(chunks=CHUNKS + (Chunk(1, []),))) == {ViolationKind.NONDETERMINISTIC: 1}


def test_staging_step_validation() -> None:
    with pytest.raises(PlanError, match="side"):
        attrs.evolve(PACK, side="both")
    with pytest.raises(PlanError, match="pages and page_staged"):
        attrs.evolve(PACK, page_staged=[0])
    with pytest.raises(PlanError, match="elements reach byte"):
        attrs.evolve(UNPACK, offsets=[8])  # 8 + 128 > the 128 B page
    with pytest.raises(PlanError, match=r"offsets\[0\]"):
        attrs.evolve(UNPACK, offsets=[-1])
    with pytest.raises(PlanError, match="rank"):
        TransferPlan(1, 1, Copies.empty(), Zeros.empty(), packs=(attrs.evolve(PACK, d_rank=1),))
    with pytest.raises(PlanError, match="side 'decode' among the packs"):
        TransferPlan(1, 1, Copies.empty(), Zeros.empty(), packs=(UNPACK,))


def test_step_element_addresses_are_the_documented_formula() -> None:
    # element (kv 1, head 1, token 3) of page entry 1 (P page 2): cache 2*128 + 64 + 8 + 3*16,
    # staging 128 + 64 + 32 + 3*8
    flat = (1 * 2 + 1) * 4 + 3
    assert int(PACK.cache_offsets(0)[1, flat]) == 2 * 128 + 64 + 8 + 3 * 16
    assert int(PACK.staging_offsets(0)[1, flat]) == 128 + 64 + 32 + 3 * 8
    assert PACK.nbytes == 2 * 16 * 8 == UNPACK.nbytes
    assert PACK.staging_span() == (0, 256)


# ---- the planner on presets -------------------------------------------------------------------------

def test_default_preset_worked_number() -> None:
    """docs/design.md §12.2: D rank 1 holds heads [2, 4), all from P rank 0, tokens [16, 100)."""
    pair, req = get_preset("gqa-tp2-tp4").build(100, 16)
    plan = pair.plan(req, strategy="packed")
    block = 4 * (10 * 2 * 2 * 8 * 256 + 2 * 2 * 4 * 256)
    assert block == 84 * 4 * 2 * 2 * 256 == 344_064
    assert plan.wire.as_array().tolist() == [[0, 0, 0, 0, 0, block], [0, 0, block, 1, 0, block],
                                             [0, 1, 0, 2, 0, block], [0, 1, block, 3, 0, block]]
    assert plan.staging_used("prefill").tolist() == [[2 * block, 2 * block]]
    assert plan.staging_used("decode").tolist() == [[block] * 4]
    full = [u for u in plan.unpacks if u.d_rank == 1 and len(u.pages) == 10]
    assert len(full) == 1 and full[0].shape == () and full[0].unit_bytes == 2 * 2 * 8 * 256  # one element per page
    assert simulate(pair, req, plan).ok


@pytest.mark.parametrize("name", ["gqa-tp2-tp4", "llama3-70b-tp8-tp4", "llama3-70b-tp4-tp8", "deepseek-v3-tp8-tp1",
                                  "qwen-swa-tp2-tp4", "kimi-linear-tp8-tp1", "nemotron-h-tp1-tp4",
                                  "qwen3-next-tp2-tp4"])
def test_wire_rows_per_pair_and_chunk(name: str) -> None:
    pair, req = get_preset(name).build(None, layers=2)
    capacity = 3 * min_staging_bytes(pair, req)
    plan = pair.plan(req, strategy="packed", staging_bytes=capacity)
    assert len(plan.wire) <= pair.prefill.num_ranks * pair.decode.num_ranks * len(plan.chunks)
    keys = plan.wire.chunk * 10_000 + plan.wire.p_rank * 100 + plan.wire.d_rank
    assert len(np.unique(keys)) == len(plan.wire)  # at most one row per (chunk, P rank, D rank)
    assert int(plan.staging_used("prefill").max()) <= capacity and int(plan.staging_used("decode").max()) <= capacity
    assert simulate(pair, req, plan, replan=pair.plan(req, strategy="packed", staging_bytes=capacity)).ok


def test_step_sizes_grow_with_pages_not_byte_runs() -> None:
    """P NHD -> D HND: a direct plan posts one row per head vector; the packed plan's steps list pages."""
    pair, small = get_preset("gqa-tp2-tp4").build(1024, 0)
    _, large = get_preset("gqa-tp2-tp4").build(4096, 0)
    pair_large = get_preset("gqa-tp2-tp4").build(4096, 0)[0]
    a, b = pair.plan(small, strategy="packed"), pair_large.plan(large, strategy="packed")
    assert len(a.packs) == len(b.packs) and len(a.unpacks) == len(b.unpacks)  # the same classes
    entries = sum(len(s.pages) for s in b.packs + b.unpacks)
    assert entries == 4 * sum(len(s.pages) for s in a.packs + a.unpacks)  # 4x the tokens, 4x the pages
    # 4096 tokens on 16-token P pages: 256 P pages; each lands in two 8-token D pages (2 pack classes),
    # for each of the 4 (P rank, D rank) pairs
    assert sum(len(s.pages) for s in b.packs) == 4 * 2 * 256
    assert entries == 4 * 2 * 256 + 4 * 512  # pack entries + 512 8-token D pages per D rank
    direct = pair_large.plan(large, strategy="direct")
    assert len(direct.copies) == 4096 * 4 * 2 * 2 * 4  # tokens x layers x planes x heads x D ranks: 64x entries


def test_chunks_by_layers() -> None:
    """Llama-3-70B-like TP8 -> TP4, 8 layers, 1024 tokens: a D rank stages 1024 x 2 x 2 x 256 B = 1 MiB per layer."""
    pair, req = get_preset("llama3-70b-tp8-tp4").build(1024, layers=8)
    per_layer = 1024 * 2 * 2 * 256
    plan = pair.plan(req, strategy="packed", staging_bytes=4 * per_layer)
    assert [str(c) for c in plan.chunks] == ["chunk 0: g0 layers [0, 4) tokens [0, 1024)",
                                             "chunk 1: g0 layers [4, 8) tokens [0, 1024)"]
    assert plan.staging_used("decode").tolist() == [[4 * per_layer] * 4] * 2
    assert plan.staging_used("prefill").tolist() == [[2 * per_layer] * 8] * 2
    assert len(plan.wire) == 2 * 8  # every P rank feeds one D rank, per chunk
    assert simulate(pair, req, plan).ok


def test_chunks_by_tokens_when_one_layer_does_not_fit() -> None:
    """The same pair with room for 300 tokens of one layer: ranges end on 16-token D pages (288)."""
    pair, req = get_preset("llama3-70b-tp8-tp4").build(1024, layers=2)
    per_token = 2 * 2 * 256
    plan = pair.plan(req, strategy="packed", staging_bytes=300 * per_token)
    ranges = [(p.token_start, p.token_stop) for c in plan.chunks for p in c.pieces if p.layer_start == 0]
    assert ranges == [(0, 288), (288, 576), (576, 864), (864, 1024)]
    assert len(plan.chunks) == 8 and all(len(c.pieces) == 1 for c in plan.chunks)
    assert simulate(pair, req, plan).ok


def test_capacity_below_one_token_is_refused_with_the_minimum() -> None:
    pair, req = get_preset("llama3-70b-tp8-tp4").build(64, layers=1)
    need = 2 * 2 * 256  # one token of one layer on a D rank: 2 planes x 2 heads x 256 B
    assert min_staging_bytes(pair, req) == need
    with pytest.raises(StagingCapacityError, match=f">= {need}") as ei:
        pair.plan(req, strategy="packed", staging_bytes=need - 1)
    assert ei.value.path == "staging_bytes" and isinstance(ei.value, ValueError)
    assert simulate(pair, req, pair.plan(req, strategy="packed", staging_bytes=need)).ok


def test_state_sections_split_when_one_layer_does_not_fit() -> None:
    pair, req = get_preset("nemotron-h-tp1-tp4").build(64, layers=1)
    plan = pair.plan(req, strategy="packed", staging_bytes=min_staging_bytes(pair, req))
    sections = [(p.section_start, p.section_stop) for c in plan.chunks for p in c.pieces if p.group == 1]
    assert len(sections) >= 2 and sections[0][0] == 0 and sections[-1][1] == 4
    assert simulate(pair, req, plan).ok


def test_nothing_to_move_is_an_empty_packed_plan() -> None:
    pair = Pair(P_ENGINE, D_ENGINE)
    req = Request(4, [GroupRequest(BlockList([5]), BlockList([1], first_token=4))], partial=True)  # P has [0, 4)
    plan = pair.plan(req, strategy="packed")
    assert not plan.wire and not plan.packs and any(n.kind is NoteKind.NOTHING_TO_MOVE for n in plan.notes)
    assert len(plan.zeros) and simulate(pair, req, plan).ok


def test_projections_of_a_packed_plan() -> None:
    pair, req = get_preset("llama3-70b-tp8-tp4").build(100, layers=2)
    plan = pair.plan(req, strategy="packed")
    assert plan.consumers().tolist() == [1] * 8 and plan.sources_of(1) == (2, 3)
    d1 = plan.for_decode_rank(1)
    assert set(d1.wire.d_rank.tolist()) == {1} and {s.d_rank for s in d1.unpacks} == {1}
    p2 = plan.packed_for_prefill_rank(2)
    assert set(p2.wire.p_rank.tolist()) == {2} and {s.p_rank for s in p2.packs} == {2} and not p2.unpacks
    assert plan.bytes_copied == plan.wire.total_bytes == 100 * 2 * 2 * 8 * 256
    assert "(packed)" in repr(plan) and "wire rows" in repr(plan)


# ---- auto -----------------------------------------------------------------------------------------------

def test_auto_packs_a_large_layout_mismatch_and_not_a_small_equal_pair() -> None:
    pair, req = get_preset("gqa-tp2-tp4").build(2048, 0)
    plan = pair.plan(req, strategy="auto")
    assert plan.packed and any(n.kind is NoteKind.AUTO_PACKED for n in plan.notes)
    m = ModelSpec("m", [AttentionSpec("attn", "full", 2, 4, 64)])
    same = Pair(EngineGeometry.build(m, tp=1, kernel_block_tokens=16, num_blocks=8, name="prefill"),
                EngineGeometry.build(m, tp=1, kernel_block_tokens=16, num_blocks=8, name="decode"))
    small = same.plan(fresh_request(same, 100), strategy="auto")
    assert not small.packed and any(n.kind is NoteKind.AUTO_DIRECT for n in small.notes)
    assert small == same.plan(fresh_request(same, 100), strategy="direct")


def test_no_staging_leaves_packed_out_of_auto() -> None:
    """staging_bytes=0 (a link without staging rings): auto plans as if packed did not exist, packed
    refuses anything that moves, and a request that moves nothing still plans."""
    pair, req = get_preset("gqa-tp2-tp4").build(2048, 0)
    plan = pair.plan(req, strategy="auto", staging_bytes=0)
    assert not plan.packed and NoteKind.AUTO_PACKED not in {n.kind for n in plan.notes}
    with pytest.raises(StagingCapacityError):
        pair.plan(req, strategy="packed", staging_bytes=0)
    empty = Pair(P_ENGINE, D_ENGINE)
    nothing = Request(4, [GroupRequest(BlockList([5]), BlockList([1], first_token=4))], partial=True)
    assert simulate(empty, nothing, empty.plan(nothing, strategy="packed", staging_bytes=0)).ok


def test_auto_weighs_packed_by_the_design_worked_number() -> None:
    """docs/design.md §5: one layer, 2 heads of 256 B, P HND K=4 (blocks 5, 1) -> D NHD K=8 (block 3),
    M = 8. Direct 32 copies = 48 us; staged 2 copies + 8192 B rearranged = 8.46 us; packed 1 wire
    row + 2 x 8192 B copied + 2 operations = 1.5 + 2.048 + 40 = 43.5 us: staged stays."""
    from kvgeom import CostModel

    m = ModelSpec("m", [AttentionSpec("attn", "full", 1, 2, 256)])
    pair = Pair(EngineGeometry.build(m, tp=1, kernel_block_tokens=4, num_blocks=8, name="prefill"),
                EngineGeometry.build(m, tp=1, kernel_block_tokens=8, num_blocks=8, layout="NHD", name="decode"))
    req = Request(8, [GroupRequest(BlockList([5, 1]), BlockList([3]))])
    cm = CostModel()
    assert cm.cost(32, 0) * 1e6 == pytest.approx(48.0)
    assert cm.cost(2, 8192) * 1e6 == pytest.approx(2 * 1.5 + 8192 / 1.5e9 * 1e6)
    assert cm.packed_cost(1, 8192, 2) * 1e6 == pytest.approx(1.5 + 2 * 8192 / 8e9 * 1e6 + 2 * 20)
    plan = pair.plan(req, strategy="auto")
    assert plan.rearranges and not plan.packed
    kinds_ = [n.kind for n in plan.notes]
    assert kinds_.count(NoteKind.AUTO_STAGED) == 2  # the group's choice, then the plan's (not packed)
    # a descriptor cost 100x higher makes the one wire row win
    dear = pair.plan(req, strategy="auto", cost_model=CostModel(descriptor_seconds=150e-6))
    assert dear.packed and NoteKind.AUTO_PACKED in [n.kind for n in dear.notes]
    assert simulate(pair, req, dear).ok


def test_posted_counts_what_coalescing_leaves() -> None:
    """The review's case: staged rows of consecutive P pages merge when they land in consecutive
    sub-pages, so counting before coalescing overstates staged; posted() counts after."""
    from kvgeom import CostModel, coalesce
    from kvgeom.planning import posted

    m = ModelSpec("m", [AttentionSpec("attn", "full", 1, 2, 256)])
    pair = Pair(EngineGeometry.build(m, tp=1, kernel_block_tokens=4, num_blocks=16, name="prefill"),
                EngineGeometry.build(m, tp=1, kernel_block_tokens=8, num_blocks=8, layout="NHD", name="decode"))
    req = fresh_request(pair, 64)
    staged = posted(pair, req, 0, "staged", CostModel())
    rows = pair.plan(req, strategy="staged")
    assert staged.exact and staged.count == len(rows.copies) == len(coalesce(rows.copies))
    # 16 consecutive P pages land in the 16 consecutive sub-pages of 8 consecutive D pages: one run
    assert rows.copies_before_coalescing == 16 and staged.count == 1
    estimate = posted(pair, req, 0, "staged", CostModel(exact_rows=0))
    assert not estimate.exact and estimate.count == 16  # past exact_rows: the count before coalescing


def _dcp_min_case(p_top: Any, d_top: Any, tokens: int) -> tuple[Any, Any]:
    m = ModelSpec("m", [AttentionSpec("attn", "full", 1, 1, 4)])  # one token of one layer: K + V = 8 B
    P = EngineGeometry.build(m, tp=p_top.dcp, kernel_block_tokens=4, num_blocks=8, name="prefill", topology=p_top)
    D = EngineGeometry.build(m, tp=d_top.dcp, kernel_block_tokens=4, num_blocks=8, name="decode", topology=d_top)
    pair = Pair(P, D)
    return pair, fresh_request(pair, tokens)


def test_min_staging_bytes_under_dcp_is_one_token_by_hand() -> None:
    """Issue 20 (4), its two examples: one token of one layer is 8 B and lands on one D rank (and
    comes from one P DCP rank); the old bound summed every pair's token (16 B)."""
    from kvgeom import Topology

    for p_top, d_top, tokens in ((Topology(), Topology(dcp=2), 8), (Topology(dcp=2), Topology(), 1)):
        pair, req = _dcp_min_case(p_top, d_top, tokens)
        assert min_staging_bytes(pair, req) == 8
        plan = pair.plan(req, strategy="packed", staging_bytes=8)
        assert simulate(pair, req, plan).ok and int(plan.staging_used("decode").max()) <= 8
        with pytest.raises(StagingCapacityError) as info:
            pair.plan(req, strategy="packed", staging_bytes=7)
        assert info.value.expected == ">= 8"  # the message names the true size


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(kst.transfers(pairs=kst.pairs(topology_probability=0.8, max_tokens=24, max_tp=4), max_tokens=24))
def test_min_staging_bytes_is_the_true_minimum_on_drawn_topologies(t: kst.Transfer) -> None:
    """Issue 20 (4): on every drawn topology (DCP, stages, replicas on either side, hybrids too)
    the packed planner plans at ``min_staging_bytes`` (and the simulator verifies it), and one byte
    less raises StagingCapacityError naming that minimum."""
    pair = Pair(*t.pair)
    need = min_staging_bytes(pair, t.request)
    if need == 0:  # nothing moves: any capacity plans
        return
    plan = pair.plan(t.request, strategy="packed", staging_bytes=need, budget=None)
    assert simulate(pair, t.request, plan).ok
    assert int(max(plan.staging_used("prefill").max(initial=0), plan.staging_used("decode").max(initial=0))) <= need
    with pytest.raises(StagingCapacityError) as info:
        pair.plan(t.request, strategy="packed", staging_bytes=need - 1, budget=None)
    assert info.value.expected == f">= {need}"
