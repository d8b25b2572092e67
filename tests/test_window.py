"""Sliding-window groups move only the window: tokens ``[max(S, ws), M)``, ``ws = max(0, M - W + 1)``.

The next token D computes is token M; with a window of W tokens that includes the query's own
token it attends to keys ``[M - W + 1, M]`` (vLLM: FlashAttention ``window_size = (W - 1, 0)``,
the sliding-window manager frees ``num_computed_tokens - W + 1`` tokens). Listed tokens before
``ws`` are zeroed on D, never copied (docs/design.md §3.4).
"""

from __future__ import annotations

import numpy as np

from kvgeom import (
    AttentionSpec,
    BlockList,
    EngineGeometry,
    GroupRequest,
    ModelSpec,
    Pair,
    Request,
    fresh_request,
    simulate,
)
from kvgeom.arith import window_start
from kvgeom.building import get_preset
from kvgeom.checking import ViolationKind
from kvgeom.values import Copies, TransferPlan

# one layer, 4 heads of 8 B, K = 4, TP1 HND K/V packed: token 8 B, head 32 B, plane 128 B, page 256 B
TOK, HEAD, PLANE, PAGE = 8, 32, 128, 256
SWA = ModelSpec("swa", [AttentionSpec("swa", "sliding", num_layers=1, num_kv_heads=4, head_bytes=8, window_tokens=4)])


def swa_pair() -> Pair:
    return Pair(EngineGeometry.build(SWA, tp=1, kernel_block_tokens=4, num_blocks=8, name="P"),
                EngineGeometry.build(SWA, tp=1, kernel_block_tokens=4, num_blocks=8, name="D"))


def test_window_start_is_vllms_rule() -> None:
    # W = 4 keys including the query: token 10 attends to 7, 8, 9 (cached) and 10 (its own)
    assert window_start(10, 4) == 7
    assert window_start(3, 4) == 0  # the window reaches back past token 0
    assert window_start(4, 4) == 1
    assert window_start(100, 1) == 100  # a 1-token window reads no cached token
    assert window_start(100, None) == 0  # full attention


def test_the_partial_first_block_is_zeroed_not_copied() -> None:
    # M = 10, window 4 -> needed [7, 10). P lists ids 3, 6 from token 4 ([4, 12)); D lists ids 1, 4, 2
    # from token 0 ([0, 12)). Token 7: P block 3 slot 3 -> D block 4 slot 3 (one 8 B run per plane
    # and head, HND); tokens 8, 9: P block 6 slots 0-1 -> D block 2 slots 0-1 (16 B per plane and head).
    # Zeros: D block 1 whole, block 4 slots 0-2 (24 B per plane and head), block 2 slots 2-3.
    request = Request(10, [GroupRequest(BlockList((3, 6), first_token=4), BlockList((1, 4, 2)))])
    plan = swa_pair().plan(request)
    expect_c = sorted([(3 * PAGE + kv * PLANE + h * HEAD + 3 * TOK, 4 * PAGE + kv * PLANE + h * HEAD + 3 * TOK, TOK)
                       for kv in range(2) for h in range(4)]
                      + [(6 * PAGE + kv * PLANE + h * HEAD, 2 * PAGE + kv * PLANE + h * HEAD, 2 * TOK)
                         for kv in range(2) for h in range(4)], key=lambda r: r[1])
    got_c = list(zip(plan.copies.p_offset.tolist(), plan.copies.d_offset.tolist(), plan.copies.nbytes.tolist()))
    assert got_c == expect_c
    assert plan.bytes_copied == 3 * 2 * 4 * 8  # 3 tokens x 2 planes x 4 heads x 8 B
    zeros = sorted([(1 * PAGE, PAGE)] + [(4 * PAGE + kv * PLANE + h * HEAD, 3 * TOK) for kv in range(2) for h in range(4)]
                   + [(2 * PAGE + kv * PLANE + h * HEAD + 2 * TOK, 2 * TOK) for kv in range(2) for h in range(4)])
    assert list(zip(plan.zeros.d_offset.tolist(), plan.zeros.nbytes.tolist())) == zeros
    assert simulate(swa_pair(), request, plan).ok


def test_the_simulator_refuses_copies_before_the_window() -> None:
    # the old rule (window from M - W = 6) copied tokens 4..6 too: D block 4 slots 0-2 must be zero
    request = Request(10, [GroupRequest(BlockList((3, 6), first_token=4), BlockList((1, 4, 2)))])
    good = swa_pair().plan(request)
    extra = Copies(np.zeros(8, np.int64), np.zeros(8, np.int64),
                   [3 * PAGE + kv * PLANE + h * HEAD for kv in range(2) for h in range(4)],
                   np.zeros(8, np.int64), np.zeros(8, np.int64),
                   [4 * PAGE + kv * PLANE + h * HEAD for kv in range(2) for h in range(4)], np.full(8, 3 * TOK))
    keep = good.zeros.d_offset // PAGE != 4  # drop the zeros of block 4's slots 0-2
    bad = TransferPlan(1, 1, Copies.concat([good.copies, extra]), good.zeros.take(keep))
    report = simulate(swa_pair(), request, bad)
    assert report.of_kind(ViolationKind.WRONG_DATA)
    assert {v.offset // PAGE for v in report.of_kind(ViolationKind.WRONG_DATA)} == {4}


def test_qwen_swa_moves_w_minus_one_tokens_of_the_window() -> None:
    # 14 full + 14 sliding layers, 4 KV heads of 256 B, window 256: a token of one layer is
    # 2 * 4 * 256 = 2048 B. M = 1000: the full group moves 1000 tokens, the sliding group
    # 1000 - window_start(1000, 256) = 1000 - 745 = 255 tokens.
    pair, request = get_preset("qwen-swa-tp2-tp4").build(tokens=1000)
    plan = pair.plan(request)
    assert window_start(1000, 256) == 745
    assert plan.bytes_copied == (1000 + 255) * 14 * 2048
    assert simulate(pair, request, plan).ok
    # the sliding listing starts at the block of token 745: P 745 // 16 * 16 = 736 (9 tokens zeroed
    # on D per layer, plane and head), D 745 // 32 * 32 = 736 as well
    assert [getattr(request.groups[1], s).first_token for s in ("prefill", "decode")] == [736, 736]
    z = plan.zeros
    # sliding: [736, 745) before the window and the tail [1000, 1024) of D's 32-token page; full: the tail
    assert z.total_bytes == 14 * 2048 * ((745 - 736) + (1024 - 1000) + (1024 - 1000))


def test_fresh_request_lists_from_the_windows_block() -> None:
    pair = swa_pair()
    r = fresh_request(pair, 10)
    assert [getattr(r.groups[0], s).first_token for s in ("prefill", "decode")] == [4, 4]  # 7 // 4 * 4
