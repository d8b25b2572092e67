"""Hybrid models (attention + mamba / linear-attention state) across TP and block sizes, checked by
the reference simulator, plus the state planner's own arithmetic on hand-checkable cases."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from kvgeom import (
    AttentionSpec,
    BlockList,
    EngineGeometry,
    GroupRequest,
    ModelSpec,
    NoteKind,
    Pair,
    Request,
    StateSection,
    StateSlots,
    StateSpec,
    fresh_request,
    simulate,
)


def kda(name: str, layers: int, heads: int = 8, head_dim: int = 4) -> StateSpec:
    """KDA / GDN-like: q, k, v short convolutions (3 rows of bf16) and the recurrent state by head."""
    ch = heads * head_dim
    return StateSpec(name, layers, [
        StateSection("q_conv", ch, 2, rows=3), StateSection("k_conv", ch, 2, rows=3),
        StateSection("v_conv", ch, 2, rows=3), StateSection("recurrent", heads, head_dim * head_dim * 4),
    ])


def kimi_like(layers: int = 2) -> ModelSpec:
    return ModelSpec("kimi-linear-like", [AttentionSpec("mla", "mla", layers, 1, 16), kda("kda_a", layers),
                                          kda("kda_b", layers)])


def mamba2(layers: int, groups: int) -> StateSpec:
    d_inner, d_state = 64, 4
    return StateSpec("mamba", layers, [
        StateSection("x", d_inner, 2, rows=3),
        StateSection("B", groups, d_state * 2, rows=3), StateSection("C", groups, d_state * 2, rows=3),
        StateSection("ssm", 8, 8 * d_state * 4),
    ])


def nemotron_like(groups: int = 8) -> ModelSpec:
    return ModelSpec("nemotron-h-like", [AttentionSpec("attn", "full", 2, 8, 16), mamba2(2, groups)])


def qwen3_next_like() -> ModelSpec:
    return ModelSpec("qwen3-next-like", [AttentionSpec("attn", "full", 2, 2, 16), StateSpec("gdn", 2, [
        StateSection("q_conv", 16, 2, rows=3), StateSection("k_conv", 16, 2, rows=3),
        StateSection("v_conv", 32, 2, rows=3), StateSection("recurrent", 8, 4 * 4 * 4),
    ])])


def engines(model: ModelSpec, p: dict[str, Any], d: dict[str, Any], M: int) -> Pair:
    nb = {}
    for side, kw in (("p", p), ("d", d)):
        lb = kw["kernel_block_tokens"] * kw.get("blocks_per_logical", 1)
        nb[side] = len(model.groups) * (M // lb + 4)
    return Pair(EngineGeometry.build(model, num_blocks=nb["p"], name="prefill", regions="shared", **p),
                EngineGeometry.build(model, num_blocks=nb["d"], name="decode", regions="shared", **d))


def check(pair: Pair, M: int, strategy: str = "direct", **kw: Any) -> None:
    req = fresh_request(pair, M, decode_tokens=M + 1, **kw)  # the mamba N-1 rule: D has N = M + 1
    plan = pair.plan(req, strategy=strategy)
    report = simulate(pair, req, plan, replan=pair.plan(req, strategy=strategy))
    assert report.ok, f"M={M}: {report}"


@pytest.mark.parametrize("direction", ["P TP8 -> D TP1", "P TP1 -> D TP8"])
def test_kimi_linear_like_5760_64_tp1_vs_768_64_tp8(direction: str) -> None:
    tp8 = dict(tp=8, kernel_block_tokens=64, blocks_per_logical=12)
    tp1 = dict(tp=1, kernel_block_tokens=64, blocks_per_logical=90)
    p, d = (tp8, tp1) if direction.startswith("P TP8") else (tp1, tp8)
    for M in (1, 768, 769, 5760, 6528):
        check(engines(kimi_like(), p, d, M), M)


@pytest.mark.parametrize("strategy", ["direct", "staged", "auto"])
@pytest.mark.parametrize("geo", [(12, 4, 8, 4), (24, 8, 8, 4)], ids=["D12/4 P8/4", "D24/8 P8/4"])
def test_harness_geometries_tp2_to_tp1_every_length(geo: tuple[int, int, int, int], strategy: str) -> None:
    dl, dk, pl, pk = geo
    for M in range(2, 49):
        pair = engines(kimi_like(1), dict(tp=2, kernel_block_tokens=pk, blocks_per_logical=pl // pk),
                       dict(tp=1, kernel_block_tokens=dk, blocks_per_logical=dl // dk), M)
        check(pair, M, strategy)


@pytest.mark.parametrize("tps", [(1, 4), (4, 1)], ids=["TP1->4", "TP4->1"])
@pytest.mark.parametrize("groups", [8, 2], ids=["B/C sharded", "B/C replicated past 2 groups"])
@pytest.mark.parametrize("layout", ["channel_major", "state_major"])
def test_nemotron_h_like(tps: tuple[int, int], groups: int, layout: str) -> None:
    for M in (1, 15, 16, 17, 40):
        pair = engines(nemotron_like(groups),
                       dict(tp=tps[0], kernel_block_tokens=16, blocks_per_logical=2, state_layout=layout),
                       dict(tp=tps[1], kernel_block_tokens=8, blocks_per_logical=4), M)
        check(pair, M, "auto")


def test_qwen3_next_like_gdn_tp2_to_tp4() -> None:
    for M in (1, 31, 32, 33, 70):
        pair = engines(qwen3_next_like(), dict(tp=2, kernel_block_tokens=16, blocks_per_logical=2),
                       dict(tp=4, kernel_block_tokens=16, blocks_per_logical=1, state_layout="state_major"), M)
        check(pair, M)


def test_state_gather_offsets_written_by_hand() -> None:
    """Mamba-like x section, 8 channels of 3 rows x 2 B; P TP4 -> D TP2, channel_major both sides.

    D rank 1 holds channels [4, 8): 2 channels from P rank 2 and 2 from P rank 3. A P rank's
    state page holds 2 channels * 6 B = 12 B, a D rank's 4 * 6 = 24 B.
    """
    model = ModelSpec("m", [StateSpec("s", 1, [StateSection("x", 8, 2, rows=3)])])
    p = EngineGeometry.build(model, tp=4, kernel_block_tokens=4, num_blocks=4, name="prefill")
    d = EngineGeometry.build(model, tp=2, kernel_block_tokens=4, num_blocks=4, name="decode")
    assert p.logical_page_bytes(0) == 12 and d.logical_page_bytes(0) == 24
    req = Request(10, [GroupRequest(StateSlots.running(3, 10), StateSlots.running(1, 10))])
    plan = Pair(p, d).plan(req)
    rows = sorted(tuple(int(x) for x in r) for r in plan.for_decode_rank(1).copies.as_array())
    assert rows == [
        (2, 0, 3 * 12, 1, 0, 1 * 24 + 0 * 6, 2 * 6),  # P rank 2 channels 4..5 -> D local 0..1
        (3, 0, 3 * 12, 1, 0, 1 * 24 + 2 * 6, 2 * 6),  # P rank 3 channels 6..7 -> D local 2..3
    ]
    assert len(plan.zeros) == 0  # state bytes are never zeroed


def test_state_major_slice_is_one_run_per_row() -> None:
    """state_major D: rows of [4 channels x 2 B]; D rank 0 (TP2) gets P TP4 rank 1's 2 channels
    as one 4 B run per row, at D columns 2..3."""
    model = ModelSpec("m", [StateSpec("s", 1, [StateSection("x", 8, 2, rows=3)])])
    p = EngineGeometry.build(model, tp=4, kernel_block_tokens=4, num_blocks=4, name="prefill")
    d = EngineGeometry.build(model, tp=2, kernel_block_tokens=4, num_blocks=4, name="decode",
                             state_layout="state_major")
    req = Request(10, [GroupRequest(StateSlots.running(0, 10), StateSlots.running(0, 10))])
    plan = Pair(p, d).plan(req)
    rows = sorted(tuple(int(x) for x in r) for r in plan.copies.as_array() if r[0] == 1 and r[3] == 0)
    # P rank 1 channel-major: channel c row w at c*6 + w*2; D row w at w*8, channel c at c*2
    assert rows == sorted((1, 0, c * 6 + w * 2, 0, 0, w * 8 + (2 + c) * 2, 2) for c in range(2) for w in range(3))


def test_unpaired_state_slots_are_noted_and_not_moved() -> None:
    model = ModelSpec("m", [StateSpec("s", 1, [StateSection("x", 4, 2)])])
    e = EngineGeometry.build(model, tp=1, kernel_block_tokens=4, num_blocks=8)
    pair = Pair(e.with_name("prefill"), e.with_name("decode"))
    # prefix caching of states: P holds states after 4, 8, 12 tokens; D lists 8 and 10 (not the running
    # state after 12: a partial transfer on purpose)
    req = Request(12, [GroupRequest(StateSlots([1, 2, 3], [4, 8, 12]), StateSlots([5, 6], [8, 10]))], partial=True)
    plan = pair.plan(req)
    assert plan.copies.as_array().tolist() == [[0, 0, 2 * 8, 0, 0, 5 * 8, 8]]
    assert any(n.kind is NoteKind.STATE_UNPAIRED and "after 10 tokens" in n.text for n in plan.notes)
    assert simulate(pair, req, plan).ok


def test_attention_and_state_share_regions_without_touching_each_other() -> None:
    pair = engines(kimi_like(1), dict(tp=2, kernel_block_tokens=4, blocks_per_logical=2),
                   dict(tp=1, kernel_block_tokens=8, blocks_per_logical=3), 30)
    req = fresh_request(pair, 30, decode_tokens=31)
    plan = pair.plan(req)
    # the D pages each group may touch are disjoint: attention blocks vs state slots
    att = req.groups[0].decode
    assert isinstance(att, BlockList)
    ppl = pair.decode.blocks_per_logical
    att_pages = {b * ppl + j for b in att.block_ids for j in range(ppl)}
    page = pair.decode.regions[0].page_bytes
    state_pages = set()
    for g in req.groups[1:]:
        assert isinstance(g.decode, StateSlots)
        state_pages |= {s * ppl + j for s in g.decode.slot_ids for j in range(ppl)}
    assert not att_pages & state_pages
    def pages(offsets: np.ndarray, nbytes: np.ndarray) -> set[int]:
        return {p for o, n in zip(offsets.tolist(), nbytes.tolist()) for p in range(o // page, (o + n - 1) // page + 1)}

    assert pages(plan.copies.d_offset, plan.copies.nbytes) <= att_pages | state_pages
    assert pages(plan.zeros.d_offset, plan.zeros.nbytes) <= att_pages  # zeros never touch a state slot
    assert simulate(pair, req, plan).ok


def test_groups_sharing_a_region_may_not_list_the_same_block() -> None:
    from kvgeom import RequestError

    pair = engines(kimi_like(1), dict(tp=1, kernel_block_tokens=4, blocks_per_logical=2),
                   dict(tp=1, kernel_block_tokens=4, blocks_per_logical=2), 8)
    ok = Request(8, [GroupRequest(BlockList([0]), BlockList([0])), GroupRequest(StateSlots.running(1, 8),
                 StateSlots.running(1, 8)), GroupRequest(StateSlots.running(2, 8), StateSlots.running(2, 8))])
    pair.check_request(ok)
    clash = Request(8, [GroupRequest(BlockList([0]), BlockList([0])), GroupRequest(StateSlots.running(1, 8),
                    StateSlots.running(0, 8)), GroupRequest(StateSlots.running(2, 8), StateSlots.running(2, 8))])
    with pytest.raises(RequestError) as err:
        pair.check_request(clash)
    assert err.value.path == "Request.groups[1](kda_a).decode.block_ids" and err.value.actual == 0
