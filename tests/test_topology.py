"""Pipeline stages, DCP token shards and PCP replicas (docs/design.md §11): the rank model, the
planner over every topology pair, and the simulator catching plans that read the wrong stage or the
wrong DCP rank.

Expected values are arithmetic written here (vLLM's partition rule, the slot formula of §11.2, the
flat rank formula of §11.1), never read back from the planner. The tiny hand-built plans:

    PP:  2 layers x 1 head of 8 B, K = 4, HND packed: a page is 2 planes * 1 head * 4 tok * 8 B = 64 B;
         P PP2 x TP1 (rank 0 = stage 0 holds region 0 = layer 0, rank 1 holds region 1), D TP1
    DCP: MLA latent of 4 B; a DCP2 side with K = 2 and interleave 1 keeps tokens 0, 2 on rank 0
         (slots 0, 1 of an 8 B page) and tokens 1, 3 on rank 1; the plain side with K = 4 keeps
         token t at byte 4 * t of a 16 B page
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings

from kvgeom import (
    AttentionGroupGeometry,
    AttentionSpec,
    AttentionView,
    BlockList,
    Copies,
    EngineGeometry,
    GeometryError,
    GroupRequest,
    IncompatibleGeometry,
    ModelSpec,
    NoteKind,
    PageLayout,
    Pair,
    Region,
    Request,
    StateSection,
    StateSpec,
    TokenShard,
    Topology,
    TransferPlan,
    ViolationKind,
    Zeros,
    fresh_request,
    layer_partition,
    pairable,
    simulate,
    verify,
)
from kvgeom.arith import locate
from kvgeom.tools import strategies as kst
from kvgeom.tools.fuzz import check_transfer
from kvgeom.tools.serialize import dumps, loads

V = ViolationKind


def _copies(rows: list[tuple[int, ...]]) -> Copies:
    return Copies(*np.array(rows, dtype=np.int64).reshape(-1, 7).T)


def _kinds(report: Any) -> set[ViolationKind]:
    return {k for k, n in report.counts.items() if n}


# ---- the rank model -------------------------------------------------------------------------------


def test_vllm_layer_partition() -> None:
    """L // pp each, the remainder one each to partitions -2, -3, ... (never the last stage)."""
    assert layer_partition(80, 2) == (40, 40)
    assert layer_partition(61, 4) == (15, 15, 16, 15)  # 61 = 4 * 15 + 1 -> partition -2
    assert layer_partition(61, 2) == (31, 30)
    assert layer_partition(7, 4) == (2, 2, 2, 1)  # 7 = 4 * 1 + 3 -> partitions -2, -3, -4
    assert layer_partition(10, 2, (3, 7)) == (3, 7)  # VLLM_PP_LAYER_PARTITION="3,7"
    for layers, pp, counts in ((2, 3, None),  # more stages than layers
                               (10, 2, (4, 7)),  # sums to 11
                               (10, 2, (0, 10)),  # an empty stage
                               (10, 3, (5, 5))):  # two counts for three stages
        with pytest.raises(GeometryError, match="topology"):
            layer_partition(layers, pp, counts)


def test_flat_rank_and_coordinates() -> None:
    """flat = (stage * replicas + replica) * tp + tp_rank; dcp rank = tp % dcp, head group = tp // dcp."""
    m = ModelSpec("m", [AttentionSpec("attn", "full", 4, 8, 16)])
    e = EngineGeometry.build(m, tp=4, kernel_block_tokens=4, num_blocks=4,
                             topology=Topology(pp=2, dcp=2, interleave=2, replicas=2))
    assert e.num_ranks == 2 * 2 * 4
    c = e.coords(13)  # 13 = (1 * 2 + 1) * 4 + 1
    assert (c.stage, c.replica, c.tp_rank, c.dcp_rank, c.head_group) == (1, 1, 1, 1, 0)
    assert e.rank_of(1, 1, replica=1) == 13
    assert [e.rank_of(s, t, r) for s in range(2) for r in range(2) for t in range(4)] == list(range(16))
    held = e.holds(13)["attn"]
    assert held["layers"].start == 2 and held["layers"].stop == 4  # 4 layers, PP2 -> [2, 4)
    assert (held["heads"].start, held["heads"].stop) == (0, 4)  # 8 heads over tp // dcp = 2 head groups
    assert held["tokens"] == TokenShard(2, 2, 1)
    assert e.logical_block_tokens == 4 * 1 * 2  # K * ppl * dcp request tokens per block id
    assert e.local_heads(0) == 4
    with pytest.raises(GeometryError):
        e.coords(16)


def test_llama_pp2_tp4_holds() -> None:
    """docs/design.md §11.1: rank 5 of PP2 x TP4 holds layers [40, 80) and heads [2, 4)."""
    m = ModelSpec("llama", [AttentionSpec("attn", "full", 80, 8, 256)])
    e = EngineGeometry.build(m, tp=4, kernel_block_tokens=16, num_blocks=2, topology=Topology(pp=2))
    h = e.holds(5)["attn"]
    assert (h["layers"].start, h["layers"].stop, h["heads"].start, h["heads"].stop) == (40, 80, 2, 4)
    assert str(h["tokens"]) == "all"
    assert e.rank_regions(5) == tuple(range(40, 80))  # per_layer: region L is layer L
    assert e.region_stage(39) == 0 and e.region_stage(40) == 1


def test_dcp_slot_arithmetic_by_hand() -> None:
    """§11.2: K = 64, ppl = 1, dcp = 8. Token 1000: block 1000 // 512 = 1, o = 488."""
    ids = np.array([4, 9])
    assert [x.tolist() for x in locate(ids, 0, 64, 1, np.array([1000]), cp=8)] == [[9], [488 // 8]]  # I = 1
    page, slot = locate(ids, 0, 64, 1, np.array([1000]), cp=8, interleave=64)
    assert (page.tolist(), slot.tolist()) == ([9], [(488 // 512) * 64 + 488 % 64])  # slot 40
    assert TokenShard(8, 1).owner(1000) == 488 % 8 == 0
    assert TokenShard(8, 64).owner(1000) == (1000 // 64) % 8 == 7
    # without DCP the formula is §3.4's
    assert [x.tolist() for x in locate(np.array([7, 3]), 0, 8, 3, np.array([30]))] == [[9], [6]]


def test_default_and_explicit_global_layer_order() -> None:
    two = [AttentionSpec("mla", "mla", 2, 1, 8), StateSpec("kda", 2, [StateSection("s", 2, 4)])]
    assert ModelSpec("m", two).layer_order() == ((0, 2), (1, 3))  # interleaved by layer index
    explicit = ModelSpec("m", two, global_layers=((0, 1), (2, 3)))
    assert explicit.layer_order() == ((0, 1), (2, 3))
    assert loads(dumps(explicit)) == explicit
    for bad in (((0, 1),), ((0, 1), (1, 3)), ((1, 0), (2, 3)), ((0, 4), (1, 2)), ((0, 1, 2), (3,))):
        with pytest.raises(GeometryError, match="global_layers"):
            ModelSpec("m", two, global_layers=bad)
    # a stage holds a contiguous slice of each group: with the explicit order, PP2 puts mla on stage 0
    e = EngineGeometry.build(explicit, tp=1, kernel_block_tokens=4, num_blocks=4, regions="shared",
                             topology=Topology(pp=2))
    assert [(e.stage_layers(g, s).start, e.stage_layers(g, s).stop) for g in range(2) for s in range(2)] == \
        [(0, 2), (2, 2), (0, 0), (0, 2)]


@pytest.mark.parametrize("regions", ["per_layer", "interleaved", "shared"])
def test_builder_gives_each_stage_its_own_regions(regions: str) -> None:
    m = ModelSpec("m", [AttentionSpec("a", "full", 3, 2, 8), AttentionSpec("b", "full", 3, 2, 8)])
    e = EngineGeometry.build(m, tp=2, kernel_block_tokens=4, num_blocks=3, regions=regions,  # type: ignore[arg-type]
                             topology=Topology(pp=2))
    # 6 global layers a0 b0 a1 b1 a2 b2 -> [3, 3]: stage 0 = a0 b0 a1, stage 1 = b1 a2 b2
    expected = {"per_layer": 6, "interleaved": 4, "shared": 4}[regions]  # interleaved: (group, stage); shared: 2 + 2
    assert len(e.regions) == expected
    s0, s1 = set(e.stage_regions(0)), set(e.stage_regions(1))
    assert s0 and s1 and not s0 & s1 and s0 | s1 == set(range(expected))


def test_topology_rules_of_an_engine() -> None:
    m = ModelSpec("m", [AttentionSpec("attn", "full", 2, 4, 8)])
    build = EngineGeometry.build
    with pytest.raises(GeometryError, match="topology.dcp"):
        build(m, tp=4, kernel_block_tokens=4, num_blocks=2, topology=Topology(dcp=3))
    with pytest.raises(GeometryError, match="topology.interleave"):
        build(m, tp=2, kernel_block_tokens=4, num_blocks=2, topology=Topology(dcp=2, interleave=3))
    with pytest.raises(GeometryError, match="topology.pp"):
        build(m, tp=1, kernel_block_tokens=4, num_blocks=2, topology=Topology(pp=3))
    with pytest.raises(GeometryError, match="topology.partition"):
        build(m, tp=1, kernel_block_tokens=4, num_blocks=2, topology=Topology(pp=2, partition=(2, 1)))
    # 3 heads over TP6 DCP2 = 3 head groups: one head each; over TP4 DCP2 = 2 head groups: 3 % 2 != 0
    three = ModelSpec("m", [AttentionSpec("attn", "full", 2, 3, 8)])
    assert build(three, tp=6, kernel_block_tokens=4, num_blocks=2, topology=Topology(dcp=2)).head_tp == 3
    with pytest.raises(GeometryError, match=r"tp // topology.dcp"):
        EngineGeometry(three, 4, 4, 1, [Region(2, 192)], [AttentionGroupGeometry(
            PageLayout.hnd(heads=1, tokens=4, head_bytes=8), [AttentionView((0, 0)), AttentionView((0, 0), 64)])],
            topology=Topology(dcp=2))
    # one region used by the layers of two stages
    lay = PageLayout.hnd(heads=4, tokens=4, head_bytes=8)
    with pytest.raises(GeometryError, match="holds layers of stage 0"):
        EngineGeometry(m, 1, 4, 1, [Region(2, 512)], [AttentionGroupGeometry(
            lay, [AttentionView((0, 0)), AttentionView((0, 0), 256)])], topology=Topology(pp=2))
    with pytest.raises(GeometryError, match="used by no layer"):
        EngineGeometry(m, 1, 4, 1, [Region(2, 256)] * 3, [AttentionGroupGeometry(
            lay, [AttentionView((0, 0)), AttentionView((1, 1))])], topology=Topology(pp=2))


def test_pair_rule_global_layer_order() -> None:
    two = [AttentionSpec("a", "full", 2, 2, 8), AttentionSpec("b", "full", 2, 2, 8)]
    p = EngineGeometry.build(ModelSpec("m", two), tp=1, kernel_block_tokens=4, num_blocks=4)
    d = EngineGeometry.build(ModelSpec("m", two, global_layers=((0, 1), (2, 3))), tp=1, kernel_block_tokens=4,
                             num_blocks=4)
    compat = pairable(p, d)
    assert not compat.ok and [r.path for r in compat.reasons] == ["decode.model.global_layers"]
    with pytest.raises(IncompatibleGeometry, match="global_layers"):
        Pair(p, d)
    # every topology difference itself pairs
    q = EngineGeometry.build(ModelSpec("m", two), tp=2, kernel_block_tokens=4, num_blocks=4,
                             topology=Topology(pp=2, dcp=2, replicas=2))
    assert pairable(p, q).ok and pairable(q, p).ok


def test_engine_and_topology_round_trip() -> None:
    m = ModelSpec("m", [AttentionSpec("attn", "full", 4, 4, 8)])
    e = EngineGeometry.build(m, tp=4, kernel_block_tokens=4, num_blocks=2,
                             topology=Topology(pp=2, partition=(1, 3), dcp=2, interleave=4, replicas=2))
    assert loads(dumps(e)) == e
    plain = EngineGeometry.build(m, tp=4, kernel_block_tokens=4, num_blocks=2)
    assert "topology" not in dumps(plain)  # one-stage documents are unchanged


# ---- planning -------------------------------------------------------------------------------------


def _pp_pair(M: int) -> tuple[Pair, Request]:
    """P PP2 x TP2 -> D TP2, 4 layers, 4 heads of 8 B, K = 4 on both sides, HND packed, per layer."""
    m = ModelSpec("m", [AttentionSpec("attn", "full", 4, 4, 8)])
    p = EngineGeometry.build(m, tp=2, kernel_block_tokens=4, num_blocks=8, topology=Topology(pp=2), name="prefill")
    d = EngineGeometry.build(m, tp=2, kernel_block_tokens=4, num_blocks=8, name="decode")
    pair = Pair(p, d)
    return pair, fresh_request(pair, M)


def test_pp_sources_consumers_and_bytes() -> None:
    pair, request = _pp_pair(10)
    plan = pair.plan(request)
    # D rank d holds heads [2d, 2d+2): layers 0-1 from P (stage 0, tp d) = rank d, layers 2-3 from rank 2 + d
    assert [plan.sources_of(d) for d in range(2)] == [(0, 2), (1, 3)]
    assert plan.consumers().tolist() == [1, 1, 1, 1]
    assert (plan.prefill_tp, plan.prefill_ranks, plan.decode_tp, plan.decode_ranks) == (2, 4, 2, 2)
    per_pair = 10 * 2 * 2 * 2 * 8  # tokens x layers per stage x planes x heads x bytes
    for p_rank in range(4):
        mine = plan.for_prefill_rank(p_rank)
        assert mine.total_bytes == per_pair
        assert set(mine.p_region.tolist()) == ({0, 1} if p_rank < 2 else {2, 3})  # only its stage's layers
    assert NoteKind.TOPOLOGY in {n.kind for n in plan.notes}
    assert simulate(pair, request, plan).ok


def test_pp_on_decode_side_and_staged() -> None:
    """D PP2: each D stage receives only its layers; staged rearranges cover each D rank's own layers."""
    m = ModelSpec("m", [AttentionSpec("attn", "full", 4, 2, 8)])
    p = EngineGeometry.build(m, tp=1, kernel_block_tokens=4, num_blocks=8, name="prefill")
    d = EngineGeometry.build(m, tp=1, kernel_block_tokens=8, num_blocks=8, layout="NHD", name="decode",
                             topology=Topology(pp=2, partition=(1, 3)))
    pair = Pair(p, d)
    request = fresh_request(pair, 12)
    plan = pair.plan(request, strategy="staged")
    assert NoteKind.STAGED in {n.kind for n in plan.notes}
    assert {(r.d_rank, r.d_region) for r in plan.rearranges} == {(0, 0), (1, 1), (1, 2), (1, 3)}
    assert set(plan.for_decode_rank(0).copies.d_region.tolist()) == {0}
    assert verify(pair, request, strategy="staged").ok and verify(pair, request, strategy="auto").ok


def test_dcp_decode_sources_spread_over_p_ranks() -> None:
    """MLA P TP8 -> D TP8 DCP8 (interleave 64): q = d, so D rank d reads its tokens from P rank d."""
    m = ModelSpec("mla", [AttentionSpec("mla", "mla", 2, 1, 16)])
    p = EngineGeometry.build(m, tp=8, kernel_block_tokens=64, num_blocks=10, name="prefill")
    d = EngineGeometry.build(m, tp=8, kernel_block_tokens=64, num_blocks=3, name="decode",
                             topology=Topology(dcp=8, interleave=64))
    pair = Pair(p, d)
    request = fresh_request(pair, 600)  # D block 0 covers 512 tokens, block 1 tokens 512..1023
    plan = pair.plan(request)
    assert [plan.sources_of(r) for r in range(8)] == [(r,) for r in range(8)]
    # D rank r owns tokens [64r, 64r + 64) of block 0; ranks 0 and 1 also own 512-575 and 576-599 of block 1
    owned = [64 + (64 if r == 0 else 24 if r == 1 else 0) for r in range(8)]
    assert [plan.for_decode_rank(r).bytes_copied for r in range(8)] == [n * 2 * 16 for n in owned]
    assert simulate(pair, request, plan).ok


def test_dcp4_to_dcp2_spreading_by_hand() -> None:
    """docs/design.md §11.3: P TP8 DCP4 (2 head groups) -> D TP8 DCP2, keys q = d // 2 + d % 2."""
    m = ModelSpec("mla", [AttentionSpec("mla", "mla", 1, 1, 8)])
    p = EngineGeometry.build(m, tp=8, kernel_block_tokens=4, num_blocks=4, name="prefill",
                             topology=Topology(dcp=4))
    d = EngineGeometry.build(m, tp=8, kernel_block_tokens=4, num_blocks=4, name="decode", topology=Topology(dcp=2))
    pair = Pair(p, d)
    request = fresh_request(pair, 16)
    plan = pair.plan(request)
    # even tokens live on P DCP ranks 0, 2 of a head group; head group (q % 2) * 4
    expected = []
    for r in range(8):
        q = r // 2 + r % 2
        group = (q % 2) * 4
        expected.append((group, group + 2) if r % 2 == 0 else (group + 1, group + 3))
    assert [plan.sources_of(r) for r in range(8)] == expected
    assert plan.consumers().tolist() == [2] * 8
    assert verify(pair, request).ok


def test_replicas_spread_reads_and_every_decode_replica_is_filled() -> None:
    m = ModelSpec("m", [AttentionSpec("attn", "full", 2, 4, 8)])
    p = EngineGeometry.build(m, tp=2, kernel_block_tokens=4, num_blocks=6, name="prefill",
                             topology=Topology(replicas=2))
    d = EngineGeometry.build(m, tp=4, kernel_block_tokens=4, num_blocks=6, name="decode")
    pair = Pair(p, d)
    request = fresh_request(pair, 9)
    plan = pair.plan(request)
    # D rank d holds head d; P tp rank d // 2 holds it; replica d % 2 -> flat (replica * 2 + d // 2)
    assert [plan.sources_of(r) for r in range(4)] == [((r % 2) * 2 + r // 2,) for r in range(4)]
    assert simulate(pair, request, plan).ok
    d2 = EngineGeometry.build(m, tp=2, kernel_block_tokens=4, num_blocks=6, name="decode",
                              topology=Topology(replicas=2))
    pair2 = Pair(p, d2)
    request2 = fresh_request(pair2, 9)
    plan2 = pair2.plan(request2)
    assert plan2.bytes_copied == 2 * 9 * 2 * 2 * 4 * 8  # both D replicas get tokens x layers x planes x heads x B
    assert simulate(pair2, request2, plan2).ok


def test_state_groups_under_pp_and_dcp() -> None:
    """A hybrid on P PP2 x TP2 -> D TP2 DCP2: each state layer from its P stage; DCP leaves state unsharded."""
    model = ModelSpec("h", [AttentionSpec("mla", "mla", 2, 1, 8),
                            StateSpec("kda", 2, [StateSection("conv", 4, 2, rows=3), StateSection("rec", 2, 16)])])
    p = EngineGeometry.build(model, tp=2, kernel_block_tokens=4, blocks_per_logical=4, num_blocks=6,
                             regions="shared", name="prefill", topology=Topology(pp=2))
    d = EngineGeometry.build(model, tp=2, kernel_block_tokens=4, blocks_per_logical=4, num_blocks=6,
                             regions="shared", name="decode", topology=Topology(dcp=2))
    pair = Pair(p, d)
    request = fresh_request(pair, 20, decode_tokens=21)
    plan = pair.plan(request)
    topo = [n.text for n in plan.notes if n.kind is NoteKind.TOPOLOGY]
    assert len(topo) == 1 and "not sharded by token" in topo[0]
    for strategy in ("direct", "staged", "auto", "packed"):
        assert verify(pair, request, strategy=strategy).ok  # type: ignore[arg-type]
    staged = pair.plan(request, strategy="staged")
    assert NoteKind.STAGED_NOT_APPLICABLE in {n.kind for n in staged.notes}  # DCP on D


def test_prefix_hit_and_sliding_window_on_dcp() -> None:
    """S sits on a D block of K * ppl * dcp tokens; a sliding group's windows align the same way."""
    m = ModelSpec("m", [AttentionSpec("full", "full", 1, 2, 8), AttentionSpec("swa", "sliding", 1, 2, 8,
                                                                              window_tokens=10)])
    p = EngineGeometry.build(m, tp=2, kernel_block_tokens=4, num_blocks=20, name="prefill",
                             topology=Topology(dcp=2, interleave=2))
    d = EngineGeometry.build(m, tp=4, kernel_block_tokens=8, num_blocks=20, name="decode",
                             topology=Topology(pp=2, dcp=2))
    pair = Pair(p, d)
    assert d.logical_block_tokens == 16
    for M, S in ((40, 16), (33, 32), (47, 0)):
        request = fresh_request(pair, M, prefix_hit_tokens=S)
        for strategy in ("direct", "staged", "auto", "packed"):
            assert verify(pair, request, strategy=strategy).ok  # type: ignore[arg-type]


def test_pp_packed_by_hand() -> None:
    """docs/design.md §12 on P PP2 x TP2 -> D TP2: one wire row per (P rank, D rank) the direct rule
    pairs, each P rank packing only its stage's layers; chunks cut by layers fall on the stage line."""
    pair, request = _pp_pair(10)
    plan = pair.plan(request, strategy="packed")
    w = plan.wire
    per_pair = 10 * 2 * 2 * 2 * 8  # tokens x layers per stage x planes x heads x bytes = 640 B
    assert sorted(zip(w.p_rank.tolist(), w.d_rank.tolist(), w.nbytes.tolist())) == \
        [(0, 0, per_pair), (1, 1, per_pair), (2, 0, per_pair), (3, 1, per_pair)]
    # D rank d's slot: P ranks ascending, so rank d's block at 0 and rank 2 + d's at 640
    assert sorted(zip(w.d_rank.tolist(), w.p_rank.tolist(), w.d_offset.tolist())) == \
        [(0, 0, 0), (0, 2, per_pair), (1, 1, 0), (1, 3, per_pair)]
    for st in plan.packs:
        assert set(st.regions.tolist()) <= set(pair.prefill.rank_regions(st.rank))
    assert simulate(pair, request, plan).ok
    # 640 B per rank: layers 0-1 (320 B per layer on each D rank) fill chunk 0, layers 2-3 chunk 1
    chunked = pair.plan(request, strategy="packed", staging_bytes=per_pair)
    assert [(c.pieces[0].layer_start, c.pieces[0].layer_stop) for c in chunked.chunks] == [(0, 2), (2, 4)]
    assert sorted(zip(chunked.wire.chunk.tolist(), chunked.wire.p_rank.tolist())) == [(0, 0), (0, 1), (1, 2), (1, 3)]
    assert simulate(pair, request, chunked).ok


def test_dcp_packed_by_hand() -> None:
    """MLA P TP8 -> D TP8 DCP8 (interleave 64), M = 600: D rank r unpacks its own tokens only, one
    wire row from P rank r (the direct rule's source) of its tokens x 2 layers x 16 B."""
    m = ModelSpec("mla", [AttentionSpec("mla", "mla", 2, 1, 16)])
    p = EngineGeometry.build(m, tp=8, kernel_block_tokens=64, num_blocks=10, name="prefill")
    d = EngineGeometry.build(m, tp=8, kernel_block_tokens=64, num_blocks=3, name="decode",
                             topology=Topology(dcp=8, interleave=64))
    pair = Pair(p, d)
    request = fresh_request(pair, 600)
    plan = pair.plan(request, strategy="packed")
    owned = [64 + (64 if r == 0 else 24 if r == 1 else 0) for r in range(8)]
    w = plan.wire
    assert w.p_rank.tolist() == w.d_rank.tolist() == list(range(8))
    assert w.nbytes.tolist() == [n * 2 * 16 for n in owned]
    assert simulate(pair, request, plan).ok


@settings(max_examples=150, derandomize=True, database=None, deadline=None,
          suppress_health_check=list(HealthCheck))
@given(kst.transfers(pairs=kst.pairs(topology_probability=1.0, mismatch_probability=0.0)))
def test_packed_wire_pairs_are_the_direct_rule(t: kst.Transfer) -> None:
    """Per (P rank, D rank), the packed plan's wire bytes equal the direct plan's copy bytes: the same
    sources (stages, head groups, DCP owners, replicas; docs/design.md §11.3 and §12)."""
    p, d = t.pair
    if not pairable(p, d):
        return
    direct = Pair(p, d).plan(t.request)
    packed = Pair(p, d).plan(t.request, strategy="packed")

    def per_pair(ps: np.ndarray, ds: np.ndarray, n: np.ndarray) -> dict[tuple[int, int], int]:
        out: dict[tuple[int, int], int] = {}
        for a, b, c in zip(ps.tolist(), ds.tolist(), n.tolist(), strict=True):
            out[(a, b)] = out.get((a, b), 0) + c
        return out

    c, w = direct.copies, packed.wire
    assert per_pair(c.p_rank, c.d_rank, c.nbytes) == per_pair(w.p_rank, w.d_rank, w.nbytes)


def test_plain_pairs_keep_ranks_equal_to_tp_and_no_topology_note() -> None:
    m = ModelSpec("m", [AttentionSpec("attn", "full", 2, 4, 8)])
    pair = Pair(EngineGeometry.build(m, tp=2, kernel_block_tokens=4, num_blocks=8),
                EngineGeometry.build(m, tp=4, kernel_block_tokens=8, num_blocks=8))
    plan = pair.plan(fresh_request(pair, 20))
    assert (plan.prefill_ranks, plan.decode_ranks) == (2, 4)
    assert NoteKind.TOPOLOGY not in {n.kind for n in plan.notes}
    assert repr(plan).splitlines()[0] == "TransferPlan P TP2 -> D TP4"


# ---- the simulator catches wrong plans (hand-built) ------------------------------------------------


def _tiny_pp() -> tuple[Pair, Request]:
    m = ModelSpec("m", [AttentionSpec("attn", "full", 2, 1, 8)])
    p = EngineGeometry.build(m, tp=1, kernel_block_tokens=4, num_blocks=2, name="prefill", topology=Topology(pp=2))
    d = EngineGeometry.build(m, tp=1, kernel_block_tokens=4, num_blocks=2, name="decode")
    request = Request(4, [GroupRequest(BlockList([1]), BlockList([1]))])
    return Pair(p, d), request


def _plan(pair: Pair, rows: list[tuple[int, ...]], zeros: Zeros | None = None) -> TransferPlan:
    return TransferPlan(pair.prefill.tp, pair.decode.tp, _copies(rows), zeros or Zeros.empty(),
                        prefill_ranks=pair.prefill.num_ranks, decode_ranks=pair.decode.num_ranks)


def test_hand_built_pp_plan_passes_and_a_wrong_stage_is_out_of_bounds() -> None:
    pair, request = _tiny_pp()
    page = 2 * 1 * 4 * 8  # 64 B
    good = [(0, 0, 1 * page, 0, 0, 1 * page, page), (1, 1, 1 * page, 0, 1, 1 * page, page)]
    assert simulate(pair, request, _plan(pair, good)).ok
    assert pair.plan(request).copies == _copies(good)
    # layer 1 read from P rank 0, whose stage 0 does not hold region 1
    wrong = [good[0], (0, 1, 1 * page, 0, 1, 1 * page, page)]
    report = simulate(pair, request, _plan(pair, wrong))
    assert V.OUT_OF_BOUNDS in _kinds(report) and V.MISSING in _kinds(report)
    # layer 0's bytes read from P rank 1 (stage 1) at region 0: also not held there
    report = simulate(pair, request, _plan(pair, [(1, 0, 1 * page, 0, 0, 1 * page, page), good[1]]))
    assert V.OUT_OF_BOUNDS in _kinds(report)


def _tiny_dcp(decode_dcp: bool) -> tuple[Pair, Request]:
    m = ModelSpec("mla", [AttentionSpec("mla", "mla", 1, 1, 4)])
    sharded = {"tp": 2, "kernel_block_tokens": 2, "topology": Topology(dcp=2)}
    plain = {"tp": 1, "kernel_block_tokens": 4}
    p = EngineGeometry.build(m, num_blocks=1, name="prefill", **(plain if decode_dcp else sharded))  # type: ignore[arg-type]
    d = EngineGeometry.build(m, num_blocks=1, name="decode", **(sharded if decode_dcp else plain))  # type: ignore[arg-type]
    return Pair(p, d), Request(4, [GroupRequest(BlockList([0]), BlockList([0]))])


def test_hand_built_dcp_decode_plan_and_a_token_on_the_wrong_rank() -> None:
    """D DCP2: tokens 0, 2 on D rank 0 (bytes 0, 4), tokens 1, 3 on D rank 1; P keeps token t at 4t."""
    pair, request = _tiny_dcp(decode_dcp=True)
    good = [(0, 0, 0, 0, 0, 0, 4), (0, 0, 8, 0, 0, 4, 4), (0, 0, 4, 1, 0, 0, 4), (0, 0, 12, 1, 0, 4, 4)]
    assert simulate(pair, request, _plan(pair, good)).ok
    assert pair.plan(request).copies == _copies(good)
    # token 1 written to D rank 0's slot of token 0 (and token 0 to rank 1): the wrong DCP rank
    swapped = [(0, 0, 4, 0, 0, 0, 4), good[1], (0, 0, 0, 1, 0, 0, 4), good[3]]
    assert V.WRONG_DATA in _kinds(simulate(pair, request, _plan(pair, swapped)))


def test_hand_built_dcp_prefill_plan_and_a_token_from_the_wrong_rank() -> None:
    """P DCP2: tokens 0, 2 on P rank 0 (bytes 0, 4), tokens 1, 3 on P rank 1; D keeps token t at 4t."""
    pair, request = _tiny_dcp(decode_dcp=False)
    good = [(0, 0, 0, 0, 0, 0, 4), (1, 0, 0, 0, 0, 4, 4), (0, 0, 4, 0, 0, 8, 4), (1, 0, 4, 0, 0, 12, 4)]
    assert simulate(pair, request, _plan(pair, good)).ok
    assert sorted(map(tuple, pair.plan(request).copies.as_array().tolist())) == sorted(good)
    # token 1 read from P rank 0 (which holds token 0 at that byte) instead of P rank 1
    wrong = [good[0], (0, 0, 0, 0, 0, 4, 4), good[2], good[3]]
    assert V.WRONG_DATA in _kinds(simulate(pair, request, _plan(pair, wrong)))


def test_missing_decode_replica_and_wrong_decode_stage_are_caught() -> None:
    m = ModelSpec("m", [AttentionSpec("attn", "full", 2, 1, 8)])
    p = EngineGeometry.build(m, tp=1, kernel_block_tokens=4, num_blocks=2, name="prefill")
    d = EngineGeometry.build(m, tp=1, kernel_block_tokens=4, num_blocks=2, name="decode",
                             topology=Topology(pp=2, replicas=2))
    pair = Pair(p, d)
    request = Request(4, [GroupRequest(BlockList([1]), BlockList([1]))])
    plan = pair.plan(request)
    # D ranks: (stage 0, replica 0) = 0, (0, 1) = 1, (1, 0) = 2, (1, 1) = 3; layer L lives in region L
    assert sorted(zip(plan.copies.d_rank.tolist(), plan.copies.d_region.tolist())) == [(0, 0), (1, 0), (2, 1), (3, 1)]
    assert simulate(pair, request, plan).ok
    c = plan.copies
    keep = c.d_rank != 1
    report = simulate(pair, request, attr_plan(plan, c.take(keep)))
    assert V.MISSING in _kinds(report)
    moved = Copies(c.p_rank, c.p_region, c.p_offset, np.where(c.d_rank == 2, 0, c.d_rank), c.d_region, c.d_offset,
                   c.nbytes)  # layer 1 written to a stage-0 rank, which does not hold region 1
    assert V.OUT_OF_BOUNDS in _kinds(simulate(pair, request, attr_plan(plan, moved)))


def attr_plan(plan: TransferPlan, copies: Copies) -> TransferPlan:
    return TransferPlan(plan.prefill_tp, plan.decode_tp, copies, plan.zeros, prefill_ranks=plan.prefill_ranks,
                        decode_ranks=plan.decode_ranks)


# ---- every topology pair, drawn -------------------------------------------------------------------


@settings(max_examples=120, derandomize=True, database=None, deadline=None,
          suppress_health_check=list(HealthCheck))
@given(kst.transfers(pairs=kst.pairs(topology_probability=1.0)))
def test_drawn_topology_pairs_verify_under_every_strategy(t: kst.Transfer) -> None:
    outcome = check_transfer(t.pair.prefill, t.pair.decode, t.request)
    assert outcome.kind == "verified", outcome.describe()


def test_describe_names_the_token_a_dcp_slot_holds() -> None:
    """D DCP2, interleave 1, K = 2: slot s of rank r's page 0 holds token 2 * s + r."""
    from kvgeom.checking import describe

    pair, request = _tiny_dcp(decode_dcp=True)
    D = pair.decode
    assert describe(D, request, "decode", 1, 0, 4) == "mla layer 0 latent token 3 head 0 byte 0"  # slot 1 of rank 1
    assert describe(D, request, "decode", 0, 0, 5) == "mla layer 0 latent token 2 head 0 byte 1"
    pp, pp_request = _tiny_pp()
    assert "not to rank 0's stage 0" in describe(pp.prefill, pp_request, "prefill", 0, 1, 0)


def test_conformance_kit_on_pipeline_stages_and_dcp() -> None:
    """A connector's rows on a topology pair, in flat ranks: kvgeom's own plan conforms; a READ of a
    layer from the stage that does not hold it lies in no region of that rank (unresolved)."""
    from kvgeom.conformance import ConnectorRows, DescriptorTable, Read, check_connector, rows_from_descriptors

    pair, request = _tiny_pp()
    assert check_connector(pair, request, ConnectorRows.from_rows(pair.plan(request).copies)).ok
    page = 2 * 1 * 4 * 8  # 64 B; P rank 0 holds region 0 at 0x1000, P rank 1 region 1 at 0x9000
    prefill_bases = [[0x1000, 0], [0, 0x9000]]  # a base for a region of another stage is never used
    decode_bases = [[0x20000, 0x30000]]
    local = DescriptorTable([0x20000 + page, 0x30000 + page], [page, page])
    good = [Read(0, 0, local, [0], DescriptorTable([0x1000 + page], [page]), [0]),
            Read(0, 1, local, [1], DescriptorTable([0x9000 + page], [page]), [0])]
    rows, unresolved = rows_from_descriptors(pair, prefill_bases=prefill_bases, decode_bases=decode_bases, reads=good)
    assert unresolved == () and check_connector(pair, request, rows).ok
    wrong = [good[0], Read(0, 0, local, [1], DescriptorTable([0x9000 + page], [page]), [0])]  # layer 1 from rank 0
    rows, unresolved = rows_from_descriptors(pair, prefill_bases=prefill_bases, decode_bases=decode_bases, reads=wrong)
    assert [u.side for u in unresolved] == ["prefill"]
    report = check_connector(pair, request, rows, unresolved=unresolved)
    assert not report.ok and {V.OUT_OF_BOUNDS, V.MISSING} <= set(report.counts)
    dcp_pair, dcp_request = _tiny_dcp(decode_dcp=True)
    assert check_connector(dcp_pair, dcp_request, ConnectorRows.from_plan(dcp_pair.plan(dcp_request))).ok


def _noted_sources(plan: TransferPlan) -> dict[int, set[int]]:
    """D rank -> the P ranks its SOURCES note names."""
    import re

    out: dict[int, set[int]] = {}
    for n in plan.notes:
        m = re.match(r"\w+: D rank (\d+) .*?<- (.*)$", n.text)
        if n.kind == NoteKind.SOURCES and m:
            out.setdefault(int(m.group(1)), set()).update(int(p) for p in re.findall(r"\bP(\d+) ", m.group(2) + " "))
    return out


def test_token_shards_meet_exactly_when_they_share_a_token() -> None:
    """TokenShard.meets against brute force over two whole periods."""
    for sa in (1, 2, 3, 4):
        for ia in (1, 2, 3, 4):
            for sb in (1, 2, 4, 8):
                for ib in (1, 2, 8):
                    for ra in range(sa):
                        for rb in range(sb):
                            a, b = TokenShard(sa, ia, ra), TokenShard(sb, ib, rb)
                            brute = any(a.holds(t) and b.holds(t) for t in range(2 * sa * ia * sb * ib))
                            assert a.meets(b) == brute, (a, b)


@pytest.mark.parametrize(("p_top", "d_top", "p_k", "d_k"), [
    (Topology(dcp=4), Topology(dcp=2), 4, 4),
    (Topology(dcp=4, interleave=2), Topology(dcp=2), 4, 8),
    (Topology(dcp=2), Topology(dcp=4, interleave=4), 8, 4),
    (Topology(dcp=8), Topology(dcp=1), 4, 16),
    (Topology(), Topology(dcp=8), 16, 8),
])
def test_dcp_source_notes_name_the_plans_sources(p_top: Topology, d_top: Topology, p_k: int, d_k: int) -> None:
    """Issue 20 (5): under DCP a D rank's note named every P DCP rank of its head group (D rank 1 of
    DCP4 -> DCP2 "<- P4, P5, P6, P7" while it reads P5 and P7); it names plan.sources_of(d), and
    the D ranks it leaves out are said to be left out."""
    m = ModelSpec("mla", [AttentionSpec("mla", "mla", 1, 1, 8)])
    p = EngineGeometry.build(m, tp=8, kernel_block_tokens=p_k, num_blocks=16, name="prefill", topology=p_top)
    d = EngineGeometry.build(m, tp=8, kernel_block_tokens=d_k, num_blocks=16, name="decode", topology=d_top)
    pair = Pair(p, d)
    plan = pair.plan(fresh_request(pair, 64))  # every token residue of every shard is in [0, 64)
    noted = _noted_sources(plan)
    assert sorted(noted) == [0, 1, 2, 3, 7]
    assert {r: set(plan.sources_of(r)) for r in noted} == noted
    assert any("ranks 4-6 left out" in n.text for n in plan.notes)
