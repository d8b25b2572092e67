"""The staged strategy and the auto choice, on hand-checkable geometries, plus the two projections
(pull and push) of one plan."""

from __future__ import annotations

import numpy as np
import pytest

from kvgeom import (
    AttentionSpec,
    BlockList,
    CostModel,
    EngineGeometry,
    GroupRequest,
    ModelSpec,
    NoteKind,
    Pair,
    Request,
    fresh_request,
    simulate,
    verify,
)

HB = 256  # head bytes


def pair_hnd_to_nhd(p_tp: int = 1, d_tp: int = 1, kp: int = 4, kd: int = 8) -> Pair:
    m = ModelSpec("m", [AttentionSpec("attn", "full", 1, 2, HB)])
    p = EngineGeometry.build(m, tp=p_tp, kernel_block_tokens=kp, num_blocks=8, name="prefill")
    d = EngineGeometry.build(m, tp=d_tp, kernel_block_tokens=kd, num_blocks=8, layout="NHD", name="decode")
    return Pair(p, d)


def test_staged_docstring_example_descriptors_and_rearrange() -> None:
    """2 heads x 256 B, K_p = 4, K_d = 8, HND -> NHD, one D page of 8 tokens from P pages 5 and 1."""
    pair = pair_hnd_to_nhd()
    req = Request(8, [GroupRequest(BlockList([5, 1]), BlockList([3]))])
    direct = pair.plan(req, strategy="direct")
    assert len(direct.copies) == 2 * 2 * 8  # planes x heads x tokens, one 256 B head vector each
    staged = pair.plan(req, strategy="staged")
    p_page, d_page = 2 * 2 * 4 * HB, 2 * 2 * 8 * HB  # 4096 B and 8192 B
    # each P page lands whole (HND, 4096 B) in its half of the D page: sub-page j at 4096 * j
    assert staged.copies.as_array().tolist() == [
        [0, 0, 5 * p_page, 0, 0, 3 * d_page + 0 * p_page, p_page],
        [0, 0, 1 * p_page, 0, 0, 3 * d_page + 1 * p_page, p_page],
    ]
    (r,) = staged.rearranges
    assert r.pages == (3,) and r.page_bytes == d_page and r.unit_bytes == HB
    # modes (sub-page, head group, plane, head, token): arrived HND inside 4-token sub-pages,
    # final NHD: token stride 2 heads * 256 = 512, head stride 256, plane stride 8 * 512 = 4096
    assert r.shape == (2, 1, 2, 2, 4)
    assert r.src_strides == (4096, 4096, 2 * 4 * HB, 4 * HB, HB)
    assert r.dst_strides == (4 * 512, 2 * HB, 8 * 512, HB, 512)
    assert simulate(pair, req, staged).ok and simulate(pair, req, direct).ok


def test_staged_gather_lands_each_p_rank_page_whole() -> None:
    """P TP2 -> D TP1 (1 head per P rank): each P page, both planes, is one 2 * 4 * 256 B copy."""
    pair = pair_hnd_to_nhd(p_tp=2)
    req = fresh_request(pair, 16)
    plan = pair.plan(req, strategy="staged")
    assert len(plan.copies) == 4 * 2  # 4 P pages x 2 P ranks
    assert set(plan.copies.nbytes.tolist()) == {2 * 4 * HB}
    assert simulate(pair, req, plan).ok


def test_staged_falls_back_to_direct_when_pages_do_not_nest() -> None:
    pair = pair_hnd_to_nhd(kp=12, kd=8)
    req = fresh_request(pair, 30)
    plan = pair.plan(req, strategy="staged")
    assert not plan.rearranges and any(n.kind is NoteKind.STAGED_NOT_APPLICABLE and "do not nest" in n.text for n in plan.notes)
    assert plan == pair.plan(req, strategy="direct")


def test_staged_equals_direct_when_layouts_agree() -> None:
    m = ModelSpec("m", [AttentionSpec("attn", "full", 2, 4, 16)])
    p = EngineGeometry.build(m, tp=2, kernel_block_tokens=8, num_blocks=8, name="prefill")
    d = EngineGeometry.build(m, tp=4, kernel_block_tokens=8, blocks_per_logical=2, num_blocks=8, name="decode")
    pair = Pair(p, d)
    req = fresh_request(pair, 20)
    plan = pair.plan(req, strategy="staged")
    assert plan == pair.plan(req, strategy="direct") and not plan.rearranges
    assert any(n.kind is NoteKind.STAGED_EQUALS_DIRECT for n in plan.notes)


def test_auto_follows_the_cost_model() -> None:
    pair = pair_hnd_to_nhd()
    req = fresh_request(pair, 32)
    direct, staged = pair.plan(req, strategy="direct"), pair.plan(req, strategy="staged")
    moved = sum(r.nbytes_per_page * len(r.pages) for r in staged.rearranges)
    # break-even descriptor cost: (direct - staged) * t == moved / bw
    bw = 1e9
    t_even = moved / bw / (len(direct.copies) - len(staged.copies))
    cheap = pair.plan(req, strategy="auto", cost_model=CostModel(t_even / 2, bw))
    dear = pair.plan(req, strategy="auto", cost_model=CostModel(t_even * 2, bw))
    assert cheap == direct and any(n.kind is NoteKind.AUTO_DIRECT for n in cheap.notes)
    assert dear == staged and any(n.kind is NoteKind.AUTO_STAGED for n in dear.notes)
    assert verify(pair, req, strategy="auto").ok


@pytest.mark.parametrize("strategy", ["direct", "staged"])
def test_pull_and_push_projections_cover_the_same_copies(strategy: str) -> None:
    m = ModelSpec("m", [AttentionSpec("attn", "full", 2, 8, 32)])
    p = EngineGeometry.build(m, tp=4, kernel_block_tokens=8, num_blocks=16, layout="NHD", name="prefill")
    d = EngineGeometry.build(m, tp=2, kernel_block_tokens=16, num_blocks=16, name="decode")
    pair = Pair(p, d)
    plan = pair.plan(fresh_request(pair, 77), strategy=strategy)

    def rows(arrays: list[np.ndarray]) -> list[tuple[int, ...]]:
        return sorted(tuple(r) for a in arrays for r in a.tolist())

    pull = rows([plan.for_decode_rank(d_rank).copies.as_array() for d_rank in range(d.tp)])
    push = rows([plan.for_prefill_rank(p_rank).as_array() for p_rank in range(p.tp)])
    assert pull == push == rows([plan.copies.as_array()])
    # every P rank serves exactly the D rank whose heads it holds: P0, P1 -> D0; P2, P3 -> D1
    assert plan.consumers().tolist() == [1, 1, 1, 1]
    assert plan.sources_of(0) == (0, 1) and plan.sources_of(1) == (2, 3)
    # the D-side steps stay with the D projection
    assert sum(len(plan.for_decode_rank(x).rearranges) for x in range(d.tp)) == len(plan.rearranges)
    assert sum(len(plan.for_decode_rank(x).zeros) for x in range(d.tp)) == len(plan.zeros)


def test_staged_rearranges_every_touched_page_of_a_token_major_d() -> None:
    """Found by the property tests: D's pages are token-major (K/V side by side per token, one
    head, so page_bytes == K * token_stride), tokens [0, 5) touch D pages 0 and 1; both need the
    rearrange, although one affine segment covers them."""
    m = ModelSpec("m", [AttentionSpec("full0", "full", 1, 1, 1)])
    p = EngineGeometry.build(m, tp=1, kernel_block_tokens=4, num_blocks=18, name="prefill")
    d = EngineGeometry.build(m, tp=1, kernel_block_tokens=4, num_blocks=18, kv="inner", name="decode")
    pair = Pair(p, d)
    req = fresh_request(pair, 5)
    plan = pair.plan(req, strategy="staged")
    assert {r.pages for r in plan.rearranges} == {(0, 1)}
    assert simulate(pair, req, plan).ok
