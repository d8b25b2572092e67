"""Coverage: listings that are too short, too long or misplaced are refused unless partial on purpose,
and requests built from block tables (docs/design.md §3.4 and §6).

Needed ranges are computed here from M, S and the window (P: [window start, M); D: [max(S, window
start), M)); block lists are written as ids and checked against those ranges by hand.
"""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings

from kvgeom import (
    AttentionSpec,
    BlockList,
    EngineGeometry,
    GroupRequest,
    ModelSpec,
    Pair,
    Request,
    RequestError,
    StateSection,
    StateSlots,
    StateSpec,
    fresh_request,
    plan_transfer,
    request_from_block_tables,
    simulate,
)
from kvgeom.arith import window_start
from kvgeom.building import state_slot_tokens
from kvgeom.tools import strategies as kst
from kvgeom.values import coverage_problems, needed_range

ATTN = ModelSpec("m", [AttentionSpec("attn", "full", num_layers=1, num_kv_heads=2, head_bytes=8)])


def pair16(model: ModelSpec = ATTN, blocks: int = 12) -> Pair:
    e = EngineGeometry.build(model, tp=1, kernel_block_tokens=16, num_blocks=blocks)
    return Pair(e.with_name("prefill"), e.with_name("decode"))


def refused(pair: Pair, request: Request) -> RequestError:
    with pytest.raises(RequestError) as err:
        pair.check_request(request)
    return err.value


def test_the_issue_example_is_refused_naming_group_side_and_ranges() -> None:
    # 16-token blocks: P lists [1, 2] = tokens [0, 32) of the 50 it computed; D lists [0, 1] = [0, 32)
    request = Request(50, [GroupRequest(BlockList([1, 2]), BlockList([0, 1]))])
    err = refused(pair16(), request)
    assert err.path == "Request.groups[0](attn).prefill"
    assert "lists tokens [0, 32)" in err.message and "needs [0, 50)" in err.message
    assert (err.actual, err.expected) == ((0, 32), (0, 50))
    # the second problem is named too, with its own expected and fix (issue 11: err.more, not the message)
    assert [m.path for m in err.more] == ["Request.groups[0](attn).decode"] and "[+1 more: " in str(err)
    assert "4 prefill block(s) from token 0" in err.fix  # ceil(50 / 16) = 4
    with pytest.raises(RequestError):
        plan_transfer(pair16().prefill, pair16().decode, request)
    with pytest.raises(RequestError):
        simulate(pair16(), request, pair16().plan(fresh_request(pair16(), 50)))


def test_partial_on_purpose_keeps_the_old_meaning() -> None:
    """A partial request moves what both sides list and zeros what D lists but does not receive."""
    pair = pair16()
    request = Request(50, [GroupRequest(BlockList([1, 2]), BlockList([0, 1, 3, 4]))], partial=True)
    plan = pair.plan(request)
    assert plan.bytes_copied == 32 * 2 * 2 * 8  # tokens [0, 32): 2 planes x 2 heads x 8 B each
    assert simulate(pair, request, plan).ok


@pytest.mark.parametrize("p, d, s, side, what", [
    (BlockList([1, 2, 3, 4, 5]), BlockList([0, 6, 7, 8]), 0, "prefill", "too long"),      # P block 5 starts at 64 >= M
    (BlockList([1, 2, 3, 4]), BlockList([0, 6, 7, 8, 9]), 0, "decode", "too long"),       # D block 4 starts at 64 > M
    (BlockList([1, 2, 3, 4]), BlockList([6, 7], 16), 16, "decode", "too short at the end"),  # [16, 48) of [16, 50)
    (BlockList([1, 2, 3, 4]), BlockList([7, 8], 32), 16, "decode", "too short at the start"),  # [32, 64) of [16, 50)
    (BlockList([2, 3, 4], 16), BlockList([0, 6, 7, 8]), 0, "prefill", "too short at the start"),  # P from 16
])
def test_short_and_long_listings(p: BlockList, d: BlockList, s: int, side: str, what: str) -> None:
    err = refused(pair16(), Request(50, [GroupRequest(p, d)], s))  # M = 50, 16-token blocks
    assert err.path == f"Request.groups[0](attn).{side}" and what in err.message


def test_what_is_accepted_at_the_edges() -> None:
    pair = pair16()
    # D allocates the block of token M itself (N = M + 1): M = 48, D lists [0, 64)
    pair.check_request(Request(48, [GroupRequest(BlockList([1, 2, 3]), BlockList([0, 4, 5, 6]))]))
    # D lists a held prefix block before S: never written, allowed
    pair.check_request(Request(50, [GroupRequest(BlockList([1, 2, 3, 4]), BlockList([0, 5, 6, 7]))], 16))
    # a full prefix hit needs nothing from D
    pair.check_request(Request(32, [GroupRequest(BlockList([1, 2]), BlockList([], 32))], 32))
    # M = 0: P lists nothing
    err = refused(pair, Request(0, [GroupRequest(BlockList([1]), BlockList([]))]))
    assert "too long" in err.message


def test_sliding_windows_need_the_window_from_window_start() -> None:
    swa = ModelSpec("s", [AttentionSpec("swa", "sliding", 1, 2, 8, window_tokens=40)])
    pair = pair16(swa)
    M = 100
    ws = window_start(M, 40)
    assert ws == 61  # max(0, 100 - 40 + 1): the next query, token 100, attends to [61, 100]
    # P from the block of token 61 (token 48): [48, 112) covers [61, 100)
    ok = Request(M, [GroupRequest(BlockList([1, 2, 3, 4], 48), BlockList([5, 6, 7, 8], 48))])
    pair.check_request(ok)
    err = refused(pair, Request(M, [GroupRequest(BlockList([2, 3, 4], 64), BlockList([5, 6, 7, 8], 48))]))
    assert err.path.endswith(".prefill") and "needs [61, 100)" in err.message and "too short at the start" in err.message
    # fresh_request lists from window_start's block on both sides (the one rule)
    fresh = fresh_request(pair, M, decode_tokens=M + 1)
    assert [getattr(fresh.groups[0], s).first_token for s in ("prefill", "decode")] == [48, 48]


def test_state_groups_need_the_running_state() -> None:
    model = ModelSpec("h", [AttentionSpec("attn", "full", 1, 2, 8),
                            StateSpec("ssm", 1, [StateSection("x", 2, 4, rows=3), StateSection("h", 2, 16)])])
    e = EngineGeometry.build(model, tp=1, kernel_block_tokens=16, num_blocks=12, regions="shared")
    pair = Pair(e.with_name("prefill"), e.with_name("decode"))
    attn = GroupRequest(BlockList([1, 2]), BlockList([3, 4]))
    err = refused(pair, Request(20, [attn, GroupRequest(StateSlots([5], [20]), StateSlots([6], [16]))]))
    assert err.path == "Request.groups[1](ssm).decode.tokens" and "after M=20" in err.message
    err = refused(pair, Request(20, [attn, GroupRequest(StateSlots([5], [20]), StateSlots([6], [24]))]))
    assert "decode state after 24 tokens" in err.message
    pair.check_request(Request(20, [attn, GroupRequest(StateSlots([5], [20]), StateSlots([6], [16]))], partial=True))


@settings(max_examples=60, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(kst.transfers(partial=False, max_tokens=48))
def test_covering_draws_pass_and_every_truncation_is_named(t: Any) -> None:
    pair = Pair(*t.pair)
    request = t.request
    assert not request.partial
    pair.check_request(request)
    for gi, (spec, gr) in enumerate(zip(pair.model.groups, request.groups)):
        for side in ("prefill", "decode"):
            listing = getattr(gr, side)
            if not isinstance(listing, BlockList) or not listing.block_ids:
                continue
            end = listing.first_token + len(listing.block_ids) * pair.side(side).logical_block_tokens
            if end - pair.side(side).logical_block_tokens >= request.computed_tokens:
                continue  # its last block holds no needed token: dropping it leaves a covering list
            if isinstance(spec, AttentionSpec):
                lo, hi = needed_range(spec, side, request.computed_tokens, request.prefix_hit_tokens)
                if lo >= hi:
                    continue  # nothing needed (a 1-token window needs no cached token): any list covers it
            short = BlockList(listing.block_ids[:-1], listing.first_token)
            groups = list(request.groups)
            groups[gi] = GroupRequest(short, gr.decode) if side == "prefill" else GroupRequest(gr.prefill, short)
            truncated = Request(request.computed_tokens, groups, request.prefix_hit_tokens)
            problems = coverage_problems(pair.model, pair.prefill, pair.decode, truncated)
            assert problems and problems[0].path == f"Request.groups[{gi}]({spec.name}).{side}"
            with pytest.raises(RequestError):
                pair.check_request(truncated)
            pair.check_request(Request(request.computed_tokens, groups, request.prefix_hit_tokens, partial=True))


# ---- requests from block tables ----------------------------------------------------------------------

def test_block_tables_place_lists_by_token() -> None:
    pair = pair16(blocks=16)
    r = request_from_block_tables(pair, 50, [[1, 2, 3, 4]], [[5, 6, 7]], prefix_hit_tokens=16)
    assert r.groups[0].prefill == BlockList([1, 2, 3, 4], 0)
    assert r.groups[0].decode == BlockList([5, 6, 7], 16)  # D lists the blocks it does not hold: from S
    with pytest.raises(RequestError) as err:
        request_from_block_tables(pair, 50, [[1, 2]], [[0, 1, 2, 3]])
    assert err.value.path == "Request.groups[0](attn).prefill" and "needs [0, 50)" in err.value.message
    with pytest.raises(RequestError, match="2 block lists for a model with 1 groups"):
        request_from_block_tables(pair, 50, [[1], [2]], [[3]])
    assert request_from_block_tables(pair, 50, [[1, 2]], [[0, 1, 2, 3]], partial=True).partial


def test_block_tables_for_sliding_groups_are_tails_unless_told() -> None:
    swa = ModelSpec("s", [AttentionSpec("full", "full", 1, 2, 8),
                          AttentionSpec("swa", "sliding", 1, 2, 8, window_tokens=40)])
    pair = pair16(swa, blocks=24)
    M = 100  # blocks of 16: token 99 is in block 6; the window needs [61, 100): blocks 3..6
    full = [list(range(7)), list(range(7, 14))]
    r = request_from_block_tables(pair, M, [full[0], [20, 21, 22, 23]], [full[1], [14, 15, 16, 17]])
    assert r.groups[1].prefill == BlockList([20, 21, 22, 23], 48)  # (ceil(100 / 16) - 4) * 16 = 48
    # vLLM's null block (id 0) before the window is skipped; the first token follows
    r2 = request_from_block_tables(pair, M, [full[0], [0, 0, 0, 20, 21, 22, 23]],
                                   [full[1], [14, 15, 16, 17]], null_block=0)
    assert r2.groups[1].prefill == BlockList([20, 21, 22, 23], 48)
    r3 = request_from_block_tables(pair, M, [full[0], [19, 20, 21, 22, 23]], [full[1], [14, 15, 16, 17]],
                                   first_tokens={"swa": (32, 48)})
    assert r3.groups[1].prefill.first_token == 32
    with pytest.raises(RequestError, match="start before token 0"):
        request_from_block_tables(pair, M, [full[0], list(range(14, 22))], [full[1], [14]])


def test_block_tables_for_hybrids_follow_vllms_state_convention() -> None:
    """P prefills M = N - 1 tokens; D allocates N = M + 1; the running state (each side's last id)
    holds M tokens on both sides, which is what fresh_request lists."""
    model = ModelSpec("h", [AttentionSpec("attn", "full", 1, 2, 8),
                            StateSpec("ssm", 1, [StateSection("x", 2, 4, rows=3), StateSection("h", 2, 16)])])
    e = EngineGeometry.build(model, tp=1, kernel_block_tokens=16, num_blocks=12, regions="shared")
    pair = Pair(e.with_name("prefill"), e.with_name("decode"))
    M = 32
    r = request_from_block_tables(pair, M, [[0, 1], [2]], [[0, 1, 2], [3]], decode_tokens=M + 1)
    assert r == fresh_request(pair, M, decode_tokens=M + 1)
    assert state_slot_tokens(1, 16, M) == (32,) and state_slot_tokens(2, 16, 40) == (32, 40)
    with pytest.raises(RequestError, match="3 state slots"):
        request_from_block_tables(pair, 20, [[0, 1], [2, 3, 4]], [[0, 1], [5]])
    r = request_from_block_tables(pair, M, [[0, 1], [2, 3]], [[0, 1, 2], [4]], decode_tokens=M + 1)
    assert r.groups[1].prefill == StateSlots([2, 3], [16, 32])  # mamba_cache_mode="all": block boundaries
