"""The worked examples E1, E2, E3, E5, E6 of docs/design.md §9 (cases first worked out for vLLM's NIXL
connector), in P/D terms and kvgeom's API. Expected offsets are written as arithmetic.

vLLM copies whole P kernel pages and zeros what lies past them; kvgeom copies exactly the tokens
P computed (``[0, M)``) and zeros everything else D lists, so where vLLM would copy the garbage
tail of a P page kvgeom zeros it instead. Each test says where that changes a number.
"""

from __future__ import annotations

from kvgeom import (
    AttentionSpec,
    BlockList,
    EngineGeometry,
    GroupRequest,
    ModelSpec,
    Pair,
    Request,
    plan_transfer,
)


def rows(cols: object) -> list[tuple[int, ...]]:
    arr = cols.as_array()  # type: ignore[attr-defined]
    return [tuple(int(x) for x in r) for r in arr]


def mla_model(token_bytes: int) -> ModelSpec:
    return ModelSpec("mla-like", [AttentionSpec("mla", "mla", num_layers=1, num_kv_heads=1, head_bytes=token_bytes)])


def test_e1_mla_single_region_d_kernel_16_p_kernel_8() -> None:
    # 4 B per token. D: K=16 -> 64 B pages, 4 pages. P: K=8 -> 32 B pages, 8 pages.
    m = mla_model(4)
    d = EngineGeometry.build(m, tp=1, kernel_block_tokens=16, num_blocks=4, name="decode")
    p = EngineGeometry.build(m, tp=1, kernel_block_tokens=8, num_blocks=8, name="prefill")
    req = Request(20, [GroupRequest(BlockList([5, 1, 6]), BlockList([2, 3]))])
    plan = plan_transfer(p, d, req)
    # tokens 0..7: P page 5 -> D page 2 slot 0; 8..15: P page 1 -> D page 2 slot 8;
    # 16..19: P page 6 -> D page 3 slot 0 (only the 4 computed tokens; vLLM copies all 8).
    assert rows(plan.copies) == [
        (0, 0, 5 * 32, 0, 0, 2 * 64, 8 * 4),
        (0, 0, 1 * 32, 0, 0, 2 * 64 + 8 * 4, 8 * 4),
        (0, 0, 6 * 32, 0, 0, 3 * 64, 4 * 4),
    ]
    # zero tokens 20..31 = D page 3 slots 4..15 (vLLM: slots 8..15, after its 8-token copy)
    assert rows(plan.zeros) == [(0, 0, 3 * 64 + 4 * 4, 12 * 4)]


def inner_model() -> ModelSpec:
    # 4 KV heads; K=1 token per page and K/V side by side: 2 * 256 B = 512 B per head per page
    return ModelSpec("gqa", [AttentionSpec("attn", "full", num_layers=1, num_kv_heads=4, head_bytes=256)])


def test_e2_d_tp2_reads_its_head_slice_from_p_tp1() -> None:
    m = inner_model()
    d = EngineGeometry.build(m, tp=2, kernel_block_tokens=1, num_blocks=4, kv="inner", name="decode")
    p = EngineGeometry.build(m, tp=1, kernel_block_tokens=1, num_blocks=6, kv="inner", name="prefill")
    assert d.regions[0].page_bytes == 2 * 512 and p.regions[0].page_bytes == 4 * 512
    req = Request(2, [GroupRequest(BlockList([5, 2]), BlockList([3, 0]))])
    plan = plan_transfer(p, d, req)
    rank1 = rows(plan.for_decode_rank(1).copies)
    # D rank 1 holds heads 2..3: offset 2 * 512 = 1024 inside each 2048 B P page
    assert sorted(rank1) == sorted([
        (0, 0, 5 * 2048 + 1024, 1, 0, 3 * 1024, 1024),
        (0, 0, 2 * 2048 + 1024, 1, 0, 0 * 1024, 1024),
    ])
    assert sorted(rows(plan.for_decode_rank(0).copies)) == sorted([
        (0, 0, 5 * 2048, 0, 0, 3 * 1024, 1024),
        (0, 0, 2 * 2048, 0, 0, 0, 1024),
    ])
    assert len(plan.zeros) == 0
    assert list(plan.consumers()) == [2]


def test_e3_p_tp2_fills_two_halves_of_each_d_page() -> None:
    m = inner_model()
    d = EngineGeometry.build(m, tp=1, kernel_block_tokens=1, num_blocks=4, kv="inner", name="decode")
    p = EngineGeometry.build(m, tp=2, kernel_block_tokens=1, num_blocks=6, kv="inner", name="prefill")
    req = Request(1, [GroupRequest(BlockList([4]), BlockList([1]))])
    plan = plan_transfer(p, d, req)
    assert rows(plan.copies) == [
        (0, 0, 4 * 1024, 0, 0, 1 * 2048, 1024),  # P rank 0: heads 0..1 -> first half
        (1, 0, 4 * 1024, 0, 0, 1 * 2048 + 1024, 1024),  # P rank 1: heads 2..3 -> second half
    ]
    assert plan.sources_of(0) == (0, 1)


def test_e5_d_24_8_vs_p_8_4_zeros_the_pages_past_m() -> None:
    # 12 B per token: D K=8 -> 96 B pages, ppl 3; P K=4 -> 48 B pages, ppl 2. M = 28 (N = 29).
    m = mla_model(12)
    d = EngineGeometry.build(m, tp=1, kernel_block_tokens=8, blocks_per_logical=3, num_blocks=8, name="decode")
    p = EngineGeometry.build(m, tp=1, kernel_block_tokens=4, blocks_per_logical=2, num_blocks=12, name="prefill")
    req = Request(28, [GroupRequest(BlockList([2, 4, 6, 8]), BlockList([1, 3]))])
    plan = plan_transfer(p, d, req)
    # D logical 1 -> kernel pages 3,4,5 (tokens 0..23); logical 3 -> pages 9,10,11 (tokens 24..47)
    # P logical 2,4,6,8 -> kernel 4,5 | 8,9 | 12,13 | 16,17, 4 tokens each
    assert rows(plan.copies) == [
        (0, 0, 4 * 48, 0, 0, 3 * 96, 8 * 12),  # tokens 0..7  (P pages 4,5 adjacent -> one run)
        (0, 0, 8 * 48, 0, 0, 4 * 96, 8 * 12),  # tokens 8..15
        (0, 0, 12 * 48, 0, 0, 5 * 96, 8 * 12),  # tokens 16..23
        (0, 0, 16 * 48, 0, 0, 9 * 96, 4 * 12),  # tokens 24..27 (P page 17 holds no computed token)
    ]
    # vLLM's 192 B (D pages 10 and 11) plus, because kvgeom does not copy P's uncomputed tokens
    # 28..31, slots 4..7 of D page 9: one range from 9*96 + 4*12 to 12*96
    assert rows(plan.zeros) == [(0, 0, 9 * 96 + 4 * 12, 12 * 96 - (9 * 96 + 4 * 12))]
    assert 12 * 96 - 10 * 96 == 192


def test_e6_partial_page_plus_whole_pages_zeroed() -> None:
    # D 32/8 (ppl 4), P 12/4 (ppl 3), 12 B per token; P computed its whole listed block: M = 12
    m = mla_model(12)
    d = EngineGeometry.build(m, tp=1, kernel_block_tokens=8, blocks_per_logical=4, num_blocks=8, name="decode")
    p = EngineGeometry.build(m, tp=1, kernel_block_tokens=4, blocks_per_logical=3, num_blocks=8, name="prefill")
    req = Request(12, [GroupRequest(BlockList([2]), BlockList([1]))])
    plan = plan_transfer(p, d, req)
    # P pages 6,7,8 (tokens 0..11) are consecutive and so are D page 4 slot 0 .. page 5 slot 3:
    # vLLM's three 48 B pairs L8..L10 <- R6..R8 coalesce into one 144 B copy
    assert rows(plan.copies) == [(0, 0, 6 * 48, 0, 0, 4 * 96, 3 * 48)]
    assert plan.copies_before_coalescing == 1  # MLA pages are token-major: one affine segment
    # partial: page 5 from token 12 (slot 4); whole: pages 6 and 7 -> one range to 8 * 96
    assert rows(plan.zeros) == [(0, 0, 5 * 96 + 4 * 12, 8 * 96 - (5 * 96 + 4 * 12))]
    assert 8 * 96 - 6 * 96 == 192  # the two whole pages of vLLM's note


def test_e6_copies_before_coalescing_counts_page_cuts_when_not_token_major() -> None:
    # the same transfer with HND heads (not token-major): one segment per P page cut
    m = ModelSpec("gqa", [AttentionSpec("attn", "full", num_layers=1, num_kv_heads=2, head_bytes=6)])
    d = EngineGeometry.build(m, tp=1, kernel_block_tokens=8, blocks_per_logical=4, num_blocks=8, name="decode")
    p = EngineGeometry.build(m, tp=1, kernel_block_tokens=4, blocks_per_logical=3, num_blocks=8, name="prefill")
    pair = Pair(p, d)
    req = Request(12, [GroupRequest(BlockList([2]), BlockList([1]))])
    plan = pair.plan(req)
    # 3 segments (tokens 0-3, 4-7, 8-11) x 2 planes x 2 heads, each a run of 4 tokens * 6 B
    assert plan.copies_before_coalescing == 3 * 2 * 2
    # one pair merges: V head 1 of tokens 4..7 ends both P page 7 and D page 4, and K head 0 of
    # tokens 8..11 starts both P page 8 and D page 5
    assert len(plan.copies) == 3 * 2 * 2 - 1
    assert sorted(plan.copies.nbytes.tolist()) == [4 * 6] * 10 + [2 * 4 * 6]
    assert plan.bytes_copied == 12 * 2 * 2 * 6
