"""The reference simulator can pass and can fail.

Every correct plan here is built by hand, with offsets written as arithmetic over the page layout
(never read back from kvgeom), and passes with zero violations. Right next to it, the same plan
with one mutation is reported with the expected violation kind.

Geometry used by most cases (``TINY``): one full-attention group, 2 layers, 4 KV heads of 8 B,
kernel pages of K = 4 tokens, ``regions="per_layer"`` (region L holds layer L), K/V packed. On TP1
an HND page is ``[kv, head, token, byte]``::

    page = 2 planes * 4 heads * 4 tokens * 8 B = 256 B
    kv_stride = 4 * 4 * 8 = 128, head_stride = 4 * 8 = 32, token_stride = 8
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any, Union

import attrs
import numpy as np
import pytest

from kvgeom import (
    AttentionGroupGeometry,
    AttentionSpec,
    AttentionView,
    BlockList,
    Copies,
    EngineGeometry,
    GeometryError,
    GroupRequest,
    KvGeomError,
    Memory,
    ModelSpec,
    NoteKind,
    PageLayout,
    Pair,
    PlanError,
    Rearrange,
    Region,
    Report,
    Request,
    RequestError,
    StateSection,
    StateSlots,
    StateSpec,
    TransferPlan,
    ViolationKind,
    Zeros,
    fresh_request,
    simulate,
)
from kvgeom.checking import (
    apply_plan,
    check_decode,
    check_plan,
    coordinate_hash,
    describe,
    fill_decode,
    fill_prefill,
    pattern_bytes,
)
from kvgeom.checking.report import LIST_LIMIT

V = ViolationKind

# ---- helpers ---------------------------------------------------------------------------------

Rows = Union[Sequence[Sequence[int]], np.ndarray]


def copies(rows: Rows) -> Copies:
    """Rows of (p_rank, p_region, p_offset, d_rank, d_region, d_offset, nbytes)."""
    arr = np.array(rows, dtype=np.int64).reshape(-1, 7)
    return Copies(*arr.T)


def zeros(rows: Rows) -> Zeros:
    """Rows of (d_rank, d_region, d_offset, nbytes)."""
    arr = np.array(rows, dtype=np.int64).reshape(-1, 4)
    return Zeros(*arr.T)


def make_plan(p_tp: int, d_tp: int, copy_rows: Rows, zero_rows: Rows = (),
              rearranges: Sequence[Rearrange] = ()) -> TransferPlan:
    return TransferPlan(p_tp, d_tp, copies(copy_rows), zeros(zero_rows), tuple(rearranges))


def kinds(report: Report) -> set[ViolationKind]:
    return {k for k, n in report.counts.items() if n}


def assert_ok(report: Report) -> None:
    assert report.ok, str(report)
    assert report.violations == ()


# ---- TINY: TP1 -> TP1, HND, whole-page copies between scattered block ids -------------------

TINY = ModelSpec("tiny", [AttentionSpec("full", "full", num_layers=2, num_kv_heads=4, head_bytes=8)])
PAGE, PLANE, HEAD, TOK = 256, 128, 32, 8  # TP1 HND page of TINY (see the module docstring)
P_IDS, D_IDS = (5, 1, 6), (2, 7, 0)  # P block i holds the same tokens as D block i


def tiny(tp: int = 1, *, layout: str = "HND", name: str = "e") -> EngineGeometry:
    return EngineGeometry.build(TINY, tp=tp, kernel_block_tokens=4, num_blocks=8, layout=layout,  # type: ignore[arg-type]
                                name=name)


def tiny_pair(p_tp: int = 1, d_tp: int = 1, *, p_layout: str = "HND") -> Pair:
    return Pair(tiny(p_tp, layout=p_layout, name="P"), tiny(d_tp, name="D"))


def tiny_request(M: int = 12, S: int = 0) -> Request:
    return Request(M, [GroupRequest(BlockList(P_IDS), BlockList(D_IDS))], S)


# M = 12: three whole blocks; layer L lives in region L; one 256 B copy per (layer, block)
WHOLE = [(0, L, P_IDS[i] * PAGE, 0, L, D_IDS[i] * PAGE, PAGE) for L in range(2) for i in range(3)]


def whole_plan(rows: Sequence[Sequence[int]] = WHOLE, zero_rows: Sequence[Sequence[int]] = ()) -> TransferPlan:
    return make_plan(1, 1, rows, zero_rows)


def test_tiny_layout_is_what_the_arithmetic_assumes() -> None:
    e = tiny()
    assert e.regions == (Region(8, PAGE), Region(8, PAGE))
    assert e.groups[0].layout == PageLayout(kv_stride=PLANE, head_stride=HEAD, token_stride=TOK)


def test_whole_pages_pass() -> None:
    report = simulate(tiny_pair(), tiny_request(), whole_plan(), replan=whole_plan())
    assert_ok(report)
    assert report.bytes_checked == 2 * 8 * PAGE  # every D byte of both regions was compared


def test_copy_one_block_off_is_wrong_data() -> None:
    rows = list(WHOLE)
    rows[0] = (0, 0, P_IDS[2] * PAGE, 0, 0, D_IDS[0] * PAGE, PAGE)  # P block 6 (tokens 8..11) into D block 2
    report = simulate(tiny_pair(), tiny_request(), whole_plan(rows))
    assert kinds(report) == {V.WRONG_DATA}
    (v,) = report.violations
    assert (v.side, v.rank, v.region, v.offset, v.nbytes) == ("decode", 0, 0, D_IDS[0] * PAGE, PAGE)
    assert "token 0 head 0 byte 0" in v.coordinate


def test_dropped_copy_is_missing() -> None:
    report = simulate(tiny_pair(), tiny_request(), whole_plan(WHOLE[1:]))
    assert kinds(report) == {V.MISSING}
    (v,) = report.violations
    assert (v.rank, v.region, v.offset, v.nbytes) == (0, 0, D_IDS[0] * PAGE, PAGE)
    assert report.bytes_bad[V.MISSING] == PAGE


def test_duplicate_copy_is_overlapping_write() -> None:
    report = simulate(tiny_pair(), tiny_request(), whole_plan(WHOLE + [WHOLE[1]]))
    assert kinds(report) == {V.OVERLAPPING_WRITE}


def test_partial_overlap_is_overlapping_write() -> None:
    extra = (0, 1, P_IDS[1] * PAGE + 8, 0, 1, D_IDS[1] * PAGE + 8, 8)  # the same 8 bytes again, inside row 4
    report = simulate(tiny_pair(), tiny_request(), whole_plan(WHOLE + [extra]))
    assert kinds(report) == {V.OVERLAPPING_WRITE}
    assert report.violations[0].offset == D_IDS[1] * PAGE + 8


def test_write_into_a_neighbours_block_is_foreign_write() -> None:
    rows = list(WHOLE)
    rows[0] = (0, 0, P_IDS[0] * PAGE, 0, 0, 3 * PAGE, PAGE)  # D block 3 belongs to another request
    report = simulate(tiny_pair(), tiny_request(), whole_plan(rows))
    assert kinds(report) == {V.FOREIGN_WRITE, V.CLOBBERED, V.MISSING}
    fw = report.of_kind(V.FOREIGN_WRITE)[0]
    assert (fw.rank, fw.region, fw.offset, fw.nbytes) == (0, 0, 3 * PAGE, PAGE)
    assert "not listed" in fw.coordinate


def test_zero_in_a_neighbours_block_is_foreign_write() -> None:
    report = simulate(tiny_pair(), tiny_request(), whole_plan(WHOLE, [(0, 1, 4 * PAGE, 16)]))
    assert kinds(report) == {V.FOREIGN_WRITE, V.CLOBBERED}


def test_read_outside_the_p_blocks_is_foreign_read() -> None:
    rows = list(WHOLE)
    rows[0] = (0, 0, 0 * PAGE, 0, 0, D_IDS[0] * PAGE, PAGE)  # P block 0 is not listed
    report = simulate(tiny_pair(), tiny_request(), whole_plan(rows))
    assert kinds(report) == {V.FOREIGN_READ, V.WRONG_DATA}
    fr = report.of_kind(V.FOREIGN_READ)[0]
    assert (fr.side, fr.rank, fr.region, fr.offset) == ("prefill", 0, 0, 0)


def test_copy_split_in_mergeable_halves_is_not_minimal() -> None:
    p, d = P_IDS[0] * PAGE, D_IDS[0] * PAGE
    halves = [(0, 0, p, 0, 0, d, PAGE // 2), (0, 0, p + PAGE // 2, 0, 0, d + PAGE // 2, PAGE // 2)]
    report = simulate(tiny_pair(), tiny_request(), whole_plan(halves + WHOLE[1:]))
    assert kinds(report) == {V.NOT_MINIMAL}
    assert report.counts[V.NOT_MINIMAL] == 1


def test_halves_adjacent_on_one_side_only_are_minimal() -> None:
    # the two halves land swapped on D: adjacent on P and on D, but not end-to-start on both
    p, d = P_IDS[0] * PAGE, D_IDS[0] * PAGE
    halves = [(0, 0, p, 0, 0, d, PAGE // 2), (0, 0, p + PAGE // 2, 0, 0, d + PAGE // 2, PAGE // 2)]
    swapped = [halves[0][:5] + (d + PAGE // 2, PAGE // 2), halves[1][:5] + (d, PAGE // 2)]
    violations = check_plan(tiny_pair(), tiny_request(), whole_plan(swapped + WHOLE[1:]))
    assert V.NOT_MINIMAL not in {v.kind for v in violations}


def test_offset_beyond_the_region_is_out_of_bounds() -> None:
    rows = list(WHOLE)
    rows[0] = (0, 0, P_IDS[0] * PAGE, 0, 0, 8 * PAGE - 8, PAGE)  # ends 248 B past the 2048 B region
    report = simulate(tiny_pair(), tiny_request(), whole_plan(rows))
    assert V.OUT_OF_BOUNDS in kinds(report)
    assert kinds(report) <= {V.OUT_OF_BOUNDS, V.MISSING}  # the row is reported, not applied
    assert report.counts[V.OUT_OF_BOUNDS] == 1
    assert [n.kind for n in report.notes] == [NoteKind.ROWS_NOT_APPLIED]
    assert report.notes[0].text == "1 out-of-bounds rows were not applied"
    assert "note: 1 out-of-bounds rows were not applied" in str(report)
    data = report.to_dict()
    assert data["note_kinds"] == ["rows_not_applied"] and data["notes"] == [report.notes[0].text]


def test_missing_region_and_rank_are_out_of_bounds() -> None:
    bad_region = list(WHOLE) + [(0, 2, 0, 0, 0, D_IDS[0] * PAGE, 8)]  # P has regions 0 and 1 only
    assert V.OUT_OF_BOUNDS in kinds(simulate(tiny_pair(), tiny_request(), whole_plan(bad_region)))
    bad_rank = make_plan(1, 2, list(WHOLE) + [(0, 0, P_IDS[0] * PAGE, 1, 0, 0, 8)])  # D has rank 0 only
    report = simulate(tiny_pair(), tiny_request(), bad_rank)
    assert V.OUT_OF_BOUNDS in kinds(report)
    assert report.counts[V.OUT_OF_BOUNDS] == 2  # the plan's decode tp, and the row


def test_apply_plan_refuses_out_of_bounds_rows() -> None:
    pair = tiny_pair()
    pmem, dmem = Memory.allocate(pair.prefill), Memory.allocate(pair.decode)
    with pytest.raises(PlanError):
        apply_plan(whole_plan([(0, 0, 0, 0, 0, 8 * PAGE, 1)]), pmem, dmem)


def test_different_replan_is_nondeterministic() -> None:
    reordered = whole_plan(WHOLE[::-1])  # the same bytes in another row order
    assert_ok(simulate(tiny_pair(), tiny_request(), reordered))
    report = simulate(tiny_pair(), tiny_request(), whole_plan(), replan=reordered)
    assert kinds(report) == {V.NONDETERMINISTIC}


# ---- TINY with a partial last block: copies per head and zeros for the tail ----------------
# M = 10: block i = 2 (P 6, D 0) holds tokens 8, 9 in slots 0, 1; slots 2, 3 of D must be zero.
# HND keeps a head's tokens together: per (plane, head) copy slots 0..1 (16 B), zero slots 2..3.

TAIL_COPIES = [(0, L, P_IDS[2] * PAGE + kv * PLANE + h * HEAD, 0, L, D_IDS[2] * PAGE + kv * PLANE + h * HEAD, 2 * TOK)
               for L in range(2) for kv in range(2) for h in range(4)]
TAIL_ZEROS = [(0, L, D_IDS[2] * PAGE + kv * PLANE + h * HEAD + 2 * TOK, 2 * TOK)
              for L in range(2) for kv in range(2) for h in range(4)]
PARTIAL = [r for r in WHOLE if r[5] != D_IDS[2] * PAGE] + TAIL_COPIES


def test_partial_block_passes() -> None:
    assert_ok(simulate(tiny_pair(), tiny_request(M=10), whole_plan(PARTIAL, TAIL_ZEROS)))


def test_whole_last_page_copied_is_beyond_computed() -> None:
    # copying all of P's page 6 brings P's tokens >= M (garbage) into bytes that must be zero: its own kind
    # (docs/design.md §7), not WRONG_DATA; under beyond_computed="any" the same bytes are BEYOND_COMPUTED too
    for policy in ("zero", "any"):
        report = simulate(tiny_pair(), tiny_request(M=10), whole_plan(WHOLE), beyond_computed=policy)
        assert kinds(report) == {V.BEYOND_COMPUTED}
        assert report.bytes_bad[V.BEYOND_COMPUTED] >= 2 * 2 * 4 * 2 * TOK - 2 * 2 * 4 * 2  # a few may match by chance


def test_dropped_zero_is_not_zeroed() -> None:
    report = simulate(tiny_pair(), tiny_request(M=10), whole_plan(PARTIAL, TAIL_ZEROS[1:]))
    assert kinds(report) == {V.NOT_ZEROED}
    (v,) = report.violations
    assert (v.region, v.offset, v.nbytes) == (0, D_IDS[2] * PAGE + 2 * TOK, 2 * TOK)
    assert "token 10 head 0" in v.coordinate


def test_zero_split_in_mergeable_halves_is_not_minimal() -> None:
    (_, L, off, n) = TAIL_ZEROS[0]
    halves = [(0, L, off, n // 2), (0, L, off + n // 2, n // 2)]
    report = simulate(tiny_pair(), tiny_request(M=10), whole_plan(PARTIAL, halves + TAIL_ZEROS[1:]))
    assert kinds(report) == {V.NOT_MINIMAL}


def test_zero_over_needed_bytes_is_wrong_data() -> None:
    extra = (0, 0, D_IDS[2] * PAGE, TOK)  # token 8 of head 0 of K: needed, now zero
    report = simulate(tiny_pair(), tiny_request(M=10), whole_plan(PARTIAL, TAIL_ZEROS + [extra]))
    assert V.WRONG_DATA in kinds(report)


# ---- TINY with a prefix hit: D already holds block 2 (tokens 0..3) ---------------------------

PREFIX = [r for r in WHOLE if r[5] != D_IDS[0] * PAGE]  # S = 4: only D blocks 7 and 0 receive data


def test_prefix_hit_passes() -> None:
    assert_ok(simulate(tiny_pair(), tiny_request(S=4), whole_plan(PREFIX)))


def test_zero_over_a_prefix_token_is_clobbered() -> None:
    report = simulate(tiny_pair(), tiny_request(S=4), whole_plan(PREFIX, [(0, 0, D_IDS[0] * PAGE, TOK)]))
    # the page is listed but D already holds it (tokens [0, S)): writing it is a FOREIGN_WRITE at plan
    # level, and the content check sees the prefix bytes changed
    assert kinds(report) == {V.CLOBBERED, V.FOREIGN_WRITE}
    assert {v.offset for v in report.violations} == {D_IDS[0] * PAGE}


# ---- tokens P does not list are zeroed, not copied ------------------------------------------


def test_tokens_beyond_the_p_listing_must_be_zero() -> None:
    # P lists only blocks 5 and 1 (tokens [0, 8)) although M = 12: D block 0 (tokens 8..11) gets zeros.
    # A listing that short is refused unless the request is partial on purpose.
    req = Request(12, [GroupRequest(BlockList(P_IDS[:2]), BlockList(D_IDS))], partial=True)
    with pytest.raises(RequestError, match=r"prefill: lists tokens \[0, 8\).*needs \[0, 12\)"):
        tiny_pair().check_request(Request(12, req.groups))
    rows = [r for r in WHOLE if r[5] != D_IDS[2] * PAGE]
    zero_rows = [(0, L, D_IDS[2] * PAGE, PAGE) for L in range(2)]
    assert_ok(simulate(tiny_pair(), req, whole_plan(rows, zero_rows)))
    report = simulate(tiny_pair(), req, whole_plan(rows))
    assert kinds(report) == {V.NOT_ZEROED}


# ---- logical blocks of two kernel pages on D (ppl = 2): alignment by token ------------------
# P: K = 4, ppl = 1 (4-token blocks). D: K = 4, ppl = 2 (8-token blocks of kernel pages 2b, 2b + 1).
# M = 12. P blocks 5, 1, 6 hold tokens [0, 4), [4, 8), [8, 12). D blocks 3, 1 hold [0, 8), [8, 16):
# D block 3 = pages 6, 7; D block 1 = pages 2, 3. Tokens 12..15 (all of page 3) must be zero.

PPL2_REQ = Request(12, [GroupRequest(BlockList(P_IDS), BlockList((3, 1)))])
PPL2_COPIES = [(0, L, p * PAGE, 0, L, d * PAGE, PAGE) for L in range(2) for p, d in ((5, 6), (1, 7), (6, 2))]
PPL2_ZEROS = [(0, L, 3 * PAGE, PAGE) for L in range(2)]


def ppl2_pair() -> Pair:
    D = EngineGeometry.build(TINY, tp=1, kernel_block_tokens=4, blocks_per_logical=2, num_blocks=4, name="D")
    return Pair(tiny(name="P"), D)


def test_two_kernel_pages_per_logical_block_pass() -> None:
    pair = ppl2_pair()
    assert pair.decode.regions == (Region(8, PAGE), Region(8, PAGE))
    assert_ok(simulate(pair, PPL2_REQ, make_plan(1, 1, PPL2_COPIES, PPL2_ZEROS)))
    assert describe(pair.decode, PPL2_REQ, "decode", 0, 0, 7 * PAGE + 2 * TOK) == "full layer 0 K token 6 head 0 byte 0"


def test_two_kernel_pages_per_logical_block_swapped_is_wrong_data() -> None:
    swapped = [(0, L, p * PAGE, 0, L, d * PAGE, PAGE) for L in range(2) for p, d in ((5, 7), (1, 6), (6, 2))]
    report = simulate(ppl2_pair(), PPL2_REQ, make_plan(1, 1, swapped, PPL2_ZEROS))
    assert kinds(report) == {V.WRONG_DATA}
    # D pages 6 and 7 are adjacent: one wrong run of two pages per layer
    assert {(v.region, v.offset, v.nbytes) for v in report.violations} == {(0, 6 * PAGE, 2 * PAGE), (1, 6 * PAGE, 2 * PAGE)}


def test_two_kernel_pages_per_logical_block_without_the_tail_zero() -> None:
    report = simulate(ppl2_pair(), PPL2_REQ, make_plan(1, 1, PPL2_COPIES))
    assert kinds(report) == {V.NOT_ZEROED}
    assert {(v.region, v.offset, v.nbytes) for v in report.violations} == {(0, 3 * PAGE, PAGE), (1, 3 * PAGE, PAGE)}


# ---- padding inside listed pages: an allowed write, but the bytes must stay -----------------


def padded(name: str) -> EngineGeometry:
    """TINY on TP1 with 300 B pages: the HND layout uses bytes [0, 256), 44 B of padding follow."""
    lay = PageLayout.hnd(heads=4, tokens=4, head_bytes=8)
    return EngineGeometry(TINY, 1, 4, 1, (Region(8, 300), Region(8, 300)),
                          (AttentionGroupGeometry(lay, (AttentionView((0, 0)), AttentionView((1, 1)))),), name=name)


def test_copy_into_padding_is_clobbered_not_foreign() -> None:
    pair = Pair(padded("P"), padded("D"))
    used = [(0, L, P_IDS[i] * 300, 0, L, D_IDS[i] * 300, PAGE) for L in range(2) for i in range(3)]
    assert_ok(simulate(pair, tiny_request(), make_plan(1, 1, used)))
    whole = [r[:6] + (300,) for r in used]  # also copies P's 44 B of padding garbage
    report = simulate(pair, tiny_request(), make_plan(1, 1, whole))
    assert kinds(report) == {V.CLOBBERED}
    assert report.violations[0].coordinate.startswith("padding")


# ---- TP1 -> TP2 and TP2 -> TP1: head slices -------------------------------------------------
# TP2 HND page: 2 planes * 2 heads * 4 tokens * 8 B = 128 B, kv_stride 64. D rank d holds heads
# [2d, 2d + 2): in the P (TP1) page they are the contiguous 64 B at kv * 128 + d * 2 * 32.

HALF = 128


def split_rows(*, flip: bool = False) -> list[tuple[int, ...]]:
    return [(0, L, P_IDS[i] * PAGE + kv * PLANE + ((1 - d) if flip else d) * 2 * HEAD,
             d, L, D_IDS[i] * HALF + kv * (HALF // 2), 2 * HEAD)
            for d in range(2) for L in range(2) for i in range(3) for kv in range(2)]


def test_head_split_passes() -> None:
    pair = tiny_pair(1, 2)
    assert pair.decode.groups[0].layout == PageLayout(kv_stride=64, head_stride=HEAD, token_stride=TOK)
    assert_ok(simulate(pair, tiny_request(), make_plan(1, 2, split_rows())))


def test_head_split_from_the_wrong_half_is_wrong_data() -> None:
    report = simulate(tiny_pair(1, 2), tiny_request(), make_plan(1, 2, split_rows(flip=True)))
    assert kinds(report) == {V.WRONG_DATA}
    assert {v.rank for v in report.violations} == {0, 1}


def test_head_gather_passes() -> None:
    # P TP2 -> D TP1: P rank p's half page plane kv (64 B at kv * 64) fills heads [2p, 2p + 2)
    rows = [(p, L, P_IDS[i] * HALF + kv * (HALF // 2), 0, L, D_IDS[i] * PAGE + kv * PLANE + p * 2 * HEAD, 2 * HEAD)
            for p in range(2) for L in range(2) for i in range(3) for kv in range(2)]
    pair = tiny_pair(2, 1)
    assert_ok(simulate(pair, tiny_request(), make_plan(2, 1, rows)))
    swapped = [(1 - r[0],) + r[1:] for r in rows]  # each half from the other P rank
    assert kinds(simulate(pair, tiny_request(), make_plan(2, 1, swapped))) == {V.WRONG_DATA}


def test_replicated_heads_pass() -> None:
    # D TP8 over 4 heads: rank r holds head r * 4 // 8 = r // 2; its page is 2 * 1 * 4 * 8 = 64 B
    rows = [(0, L, P_IDS[i] * PAGE + kv * PLANE + (r // 2) * HEAD, r, L, D_IDS[i] * 64 + kv * HEAD, HEAD)
            for r in range(8) for L in range(2) for i in range(3) for kv in range(2)]
    pair = tiny_pair(1, 8)
    assert_ok(simulate(pair, tiny_request(), make_plan(1, 8, rows)))
    wrong = [r[:2] + (r[2] - (r[3] // 2) * HEAD + (r[3] % 4) * HEAD,) + r[3:] for r in rows]  # head r % 4
    report = simulate(pair, tiny_request(), make_plan(1, 8, wrong))
    assert kinds(report) == {V.WRONG_DATA}
    # ranks 1..6 have r % 4 != r // 2; each gets 3 wrong pages (not adjacent) in each of 2 layers
    assert report.counts[V.WRONG_DATA] == 6 * 2 * 3
    assert {v.rank for v in report.violations} <= {1, 2, 3, 4, 5, 6}


def test_mla_latent_goes_to_every_rank() -> None:
    model = ModelSpec("mla", [AttentionSpec("lat", "mla", num_layers=1, num_kv_heads=1, head_bytes=16)])
    P = EngineGeometry.build(model, tp=1, kernel_block_tokens=4, num_blocks=8, name="P")
    D = EngineGeometry.build(model, tp=2, kernel_block_tokens=4, num_blocks=8, name="D")
    page = 1 * 1 * 4 * 16  # one plane, one latent, 4 tokens
    req = Request(12, [GroupRequest(BlockList(P_IDS), BlockList(D_IDS))])
    rows = [(0, 0, P_IDS[i] * page, d, 0, D_IDS[i] * page, page) for d in range(2) for i in range(3)]
    assert_ok(simulate(Pair(P, D), req, make_plan(1, 2, rows)))
    report = simulate(Pair(P, D), req, make_plan(1, 2, rows[:3]))  # rank 1 gets nothing
    assert kinds(report) == {V.MISSING}
    assert {v.rank for v in report.violations} == {1}


# ---- state groups ----------------------------------------------------------------------------
# channel_major. TP1: x = 4 channels * 3 rows * 6 B = 72 B at 0, ssm = 4 * 16 B = 64 B at 72:
# 136 B. TP2: x = 2 * 18 = 36 B at 0, ssm = 2 * 16 = 32 B at 36: 68 B (one page each, ppl = 1).

MAMBA = ModelSpec("m", [StateSpec("mamba", 1, [StateSection("x", channels=4, unit_bytes=6, rows=3),
                                               StateSection("ssm", channels=4, unit_bytes=16)])])


def mamba_pair(d_tp: int = 1) -> Pair:
    return Pair(EngineGeometry.build(MAMBA, tp=1, kernel_block_tokens=4, num_blocks=8, name="P"),
                EngineGeometry.build(MAMBA, tp=d_tp, kernel_block_tokens=4, num_blocks=8, name="D"))


def state_request(p_slots: tuple[int, ...] = (3,), p_tokens: tuple[int, ...] = (12,), d_tokens: int = 12) -> Request:
    return Request(12, [GroupRequest(StateSlots(p_slots, p_tokens), StateSlots((5,), (d_tokens,)))])


def test_state_page_sizes() -> None:
    assert mamba_pair(2).prefill.regions == (Region(8, 136),)
    assert mamba_pair(2).decode.regions == (Region(8, 68),)


def test_state_copy_passes() -> None:
    assert_ok(simulate(mamba_pair(), state_request(), make_plan(1, 1, [(0, 0, 3 * 136, 0, 0, 5 * 136, 136)])))


def test_state_channel_split_passes() -> None:
    rows = [r for d in range(2) for r in ((0, 0, 3 * 136 + d * 36, d, 0, 5 * 68, 36),  # x channels [2d, 2d+2)
                                          (0, 0, 3 * 136 + 72 + d * 32, d, 0, 5 * 68 + 36, 32))]  # ssm
    assert_ok(simulate(mamba_pair(2), state_request(), make_plan(1, 2, rows)))
    short = [r[:6] + (r[6] - 1,) for r in rows]  # one byte short per section
    assert kinds(simulate(mamba_pair(2), state_request(), make_plan(1, 2, short))) == {V.MISSING}


def test_state_from_the_wrong_position_is_wrong_data() -> None:
    # P lists the state after 8 tokens (slot 3) and after 12 (slot 4); D wants the one after 12
    req = state_request((3, 4), (8, 12))
    assert_ok(simulate(mamba_pair(), req, make_plan(1, 1, [(0, 0, 4 * 136, 0, 0, 5 * 136, 136)])))
    report = simulate(mamba_pair(), req, make_plan(1, 1, [(0, 0, 3 * 136, 0, 0, 5 * 136, 136)]))
    assert kinds(report) == {V.WRONG_DATA}


def test_unpaired_state_slot_stays_untouched() -> None:
    # no P state after 13 tokens: nothing to send (a D state past M is refused unless partial on purpose)
    req = attrs.evolve(state_request(d_tokens=13), partial=True)
    assert_ok(simulate(mamba_pair(), req, make_plan(1, 1, [])))
    report = simulate(mamba_pair(), req, make_plan(1, 1, [(0, 0, 3 * 136, 0, 0, 5 * 136, 136)]))
    assert kinds(report) == {V.CLOBBERED}


# ---- sliding window: alignment by token position --------------------------------------------
# window 4, K = 4, M = 10. P lists its blocks from token 4 (ids 3, 6 -> tokens [4, 12)); D lists
# from token 0 (ids 1, 4, 2 -> tokens [0, 12)). The next query, token 10, attends to [7, 10]
# (window_start = 10 - 4 + 1 = 7): needed [7, 10); must be zero: [0, 7) and [10, 12).

SWA = ModelSpec("swa", [AttentionSpec("swa", "sliding", num_layers=1, num_kv_heads=4, head_bytes=8, window_tokens=4)])
SWA_REQ = Request(10, [GroupRequest(BlockList((3, 6), first_token=4), BlockList((1, 4, 2)))])
SWA_COPIES = [(0, 0, 3 * PAGE + kv * PLANE + h * HEAD + 3 * TOK, 0, 0, 4 * PAGE + kv * PLANE + h * HEAD + 3 * TOK, TOK)
              for kv in range(2) for h in range(4)] + [
    (0, 0, 6 * PAGE + kv * PLANE + h * HEAD, 0, 0, 2 * PAGE + kv * PLANE + h * HEAD, 2 * TOK)
    for kv in range(2) for h in range(4)]
SWA_ZEROS = [(0, 0, 1 * PAGE, PAGE)] + [(0, 0, 4 * PAGE + kv * PLANE + h * HEAD, 3 * TOK)
                                        for kv in range(2) for h in range(4)] + [
    (0, 0, 2 * PAGE + kv * PLANE + h * HEAD + 2 * TOK, 2 * TOK) for kv in range(2) for h in range(4)]


def swa_pair() -> Pair:
    return Pair(EngineGeometry.build(SWA, tp=1, kernel_block_tokens=4, num_blocks=8, name="P"),
                EngineGeometry.build(SWA, tp=1, kernel_block_tokens=4, num_blocks=8, name="D"))


def test_sliding_window_passes() -> None:
    assert_ok(simulate(swa_pair(), SWA_REQ, make_plan(1, 1, SWA_COPIES, SWA_ZEROS)))


def test_sliding_window_aligned_by_count_is_caught() -> None:
    # counting blocks from the front pairs P block 3 (tokens 4..7) with D block 1 (tokens 0..3)
    rows = [(0, 0, 3 * PAGE, 0, 0, 1 * PAGE, PAGE), (0, 0, 6 * PAGE, 0, 0, 4 * PAGE, PAGE)]
    report = simulate(swa_pair(), SWA_REQ, make_plan(1, 1, rows, SWA_ZEROS[1:]))
    assert V.WRONG_DATA in kinds(report)
    assert V.MISSING in kinds(report)  # D block 2's tokens 8, 9 never arrive


def test_sliding_window_skipping_the_leading_zero_is_not_zeroed() -> None:
    report = simulate(swa_pair(), SWA_REQ, make_plan(1, 1, SWA_COPIES, SWA_ZEROS[1:]))
    assert kinds(report) == {V.NOT_ZEROED}
    assert report.violations[0].offset == 1 * PAGE


# ---- staged: whole pages, then a rearrange NHD -> HND inside each D page ---------------------
# P TP1 NHD page: [kv, token, head, byte], kv_stride 128, token_stride 4 * 8 = 32, head_stride 8.
# Elements (kv, head, token) of 8 B move from kv*128 + head*8 + token*32 to kv*128 + head*32 + token*8.


def staged(pages: Sequence[int] = D_IDS, *, dst_strides: tuple[int, int, int] = (PLANE, HEAD, TOK),
           dst_offset: int = 0, page_bytes: int = PAGE) -> TransferPlan:
    rearr = [Rearrange(0, L, tuple(pages), (2, 4, 4), (PLANE, 8, 32), dst_strides, unit_bytes=TOK,
                       dst_offset=dst_offset, page_bytes=page_bytes) for L in range(2)]
    return make_plan(1, 1, WHOLE, rearranges=rearr)


def test_staged_rearrange_passes() -> None:
    pair = tiny_pair(p_layout="NHD")
    assert pair.prefill.groups[0].layout == PageLayout(kv_stride=PLANE, head_stride=8, token_stride=32)
    assert_ok(simulate(pair, tiny_request(), staged()))


def test_staged_without_rearrange_is_wrong_data() -> None:
    assert kinds(simulate(tiny_pair(p_layout="NHD"), tiny_request(), whole_plan())) == {V.WRONG_DATA}


def test_rearrange_of_a_foreign_page_is_foreign_write() -> None:
    report = simulate(tiny_pair(p_layout="NHD"), tiny_request(), staged(D_IDS + (3,)))
    assert V.FOREIGN_WRITE in kinds(report)
    assert kinds(report) <= {V.FOREIGN_WRITE, V.FOREIGN_READ, V.CLOBBERED}
    assert {v.offset for v in report.of_kind(V.FOREIGN_WRITE)} == {3 * PAGE}


def test_rearrange_leaving_its_declared_page_is_rejected_when_built() -> None:
    with pytest.raises(PlanError) as err:
        staged(dst_offset=TOK)  # last element ends at PAGE + TOK
    assert err.value.path == "Rearrange.dst_strides"


def test_rearrange_leaving_its_page_is_out_of_bounds() -> None:
    # declares a page twice the region's: it passes construction, the simulator refuses it
    report = simulate(tiny_pair(p_layout="NHD"), tiny_request(), staged(dst_offset=TOK, page_bytes=2 * PAGE))
    assert V.OUT_OF_BOUNDS in kinds(report)
    assert report.counts[V.OUT_OF_BOUNDS] == 2  # one per layer's rearrange, neither applied


def test_rearrange_with_colliding_destinations_is_overlapping_write() -> None:
    report = simulate(tiny_pair(p_layout="NHD"), tiny_request(), staged(dst_strides=(PLANE, TOK, TOK)))
    assert V.OVERLAPPING_WRITE in kinds(report)


# ---- the hash, the fills and describe --------------------------------------------------------

_MASK = (1 << 64) - 1
_GOLD = 0x9E3779B97F4A7C15


def _py_mix(z: int) -> int:
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9 & _MASK
    z = (z ^ (z >> 27)) * 0x94D049BB133111EB & _MASK
    return z ^ (z >> 31)


def _py_hash(seed: int, fields: Sequence[int], byte: int) -> int:
    key = seed
    for f in fields:
        key = _py_mix(((key ^ f) + _GOLD) & _MASK)
    word = _py_mix((key + (byte // 8 + 1) * _GOLD) & _MASK)
    return (word >> (8 * (byte % 8))) & 0xFF


def test_coordinate_hash_is_the_documented_formula() -> None:
    # attention: seed "attn", fields (group, layer, plane, head, token); state: seed "stat",
    # fields (group, layer, section, state tokens, channel, row)
    got = coordinate_hash(1, 3, token=37, plane=1, head=5, nbytes=20)
    assert got.tolist() == [_py_hash(0x6174746E, (1, 3, 1, 5, 37), b) for b in range(20)]
    got = coordinate_hash(0, 2, section=1, channel=7, row=2, state_tokens=40, nbytes=11)
    assert got.tolist() == [_py_hash(0x73746174, (0, 2, 1, 40, 7, 2), b) for b in range(11)]


def test_coordinate_hash_separates_every_field() -> None:
    base = dict(token=3, plane=0, head=1)
    ref = coordinate_hash(0, 0, nbytes=16, **base)
    for field, other in (("token", 4), ("plane", 1), ("head", 2)):
        assert not np.array_equal(coordinate_hash(0, 0, nbytes=16, **dict(base, **{field: other})), ref)
    assert not np.array_equal(coordinate_hash(1, 0, nbytes=16, **base), ref)
    assert not np.array_equal(coordinate_hash(0, 1, nbytes=16, **base), ref)
    s = coordinate_hash(0, 0, section=0, channel=0, row=0, state_tokens=12, nbytes=16)
    assert not np.array_equal(coordinate_hash(0, 0, section=0, channel=0, row=0, state_tokens=11, nbytes=16), s)


def test_fill_prefill_puts_the_hash_at_the_model_address() -> None:
    pair, req = tiny_pair(), tiny_request(M=10)
    mem = Memory.allocate(pair.prefill)
    fill_prefill(pair, req, mem)
    # layer 1 (region 1), V, token 5 = P block index 1 (id 1), slot 1; head 2
    off = P_IDS[1] * PAGE + PLANE + 2 * HEAD + 1 * TOK
    assert mem.buffers[0][1][off:off + 8].tolist() == coordinate_hash(0, 1, token=5, plane=1, head=2, nbytes=8).tolist()
    # token 10 >= M: P never computed it, the page holds garbage there
    off = P_IDS[2] * PAGE + 2 * TOK
    assert mem.buffers[0][0][off:off + 8].tolist() == pattern_bytes(0x50676172, 0, 0, np.arange(off, off + 8)).tolist()


def test_fill_decode_holds_the_prefix_and_stale_bytes() -> None:
    pair, req = tiny_pair(), tiny_request(S=4)
    mem = Memory.allocate(pair.decode)
    fill_decode(pair, req, mem)
    off = D_IDS[0] * PAGE + 3 * TOK  # token 3, K, head 0: a prefix token D already holds
    assert mem.buffers[0][0][off:off + 8].tolist() == coordinate_hash(0, 0, token=3, plane=0, head=0, nbytes=8).tolist()
    off = D_IDS[1] * PAGE  # token 4: stale until the transfer
    assert mem.buffers[0][0][off:off + 8].tolist() == pattern_bytes(0x4473746C, 0, 0, np.arange(off, off + 8)).tolist()


def test_describe_names_the_coordinate() -> None:
    off = P_IDS[1] * PAGE + PLANE + 2 * HEAD + 3 * TOK + 5  # V, head 2, slot 3 of P block 1 (index 1)
    text = describe(tiny(), tiny_request(), "prefill", 0, 1, off)
    assert text == "full layer 1 V token 7 head 2 byte 5"


# ---- check_plan / check_decode directly, Memory.wrap ------------------------------------------


def test_check_plan_and_check_decode_on_wrapped_memory() -> None:
    pair, req = tiny_pair(), tiny_request()
    assert check_plan(pair, req, whole_plan(), replan=whole_plan()) == []
    raw_p = [[np.empty(8 * PAGE, np.uint8), np.empty(8 * PAGE, np.uint8)]]
    raw_d = [[np.empty((8, PAGE), np.uint8), np.empty((8, PAGE), np.uint8)]]  # page-shaped, like a tensor
    pmem, dmem = Memory.wrap(pair.prefill, raw_p), Memory.wrap(pair.decode, raw_d)
    fill_prefill(pair, req, pmem)
    fill_decode(pair, req, dmem)
    apply_plan(whole_plan(), pmem, dmem)
    violations, checked = check_decode(pair, req, dmem)
    assert violations == [] and checked == 2 * 8 * PAGE
    # the wrapped arrays are the memory: damage one byte of the original and the check sees it
    raw_d[0][1][D_IDS[1], 0] ^= 0xFF
    violations, _ = check_decode(pair, req, dmem)
    assert [(v.kind, v.region, v.offset, v.nbytes) for v in violations] == [(V.WRONG_DATA, 1, D_IDS[1] * PAGE, 1)]


@pytest.mark.parametrize("case", ["ranks", "regions", "size", "dtype", "strided", "type"])
def test_memory_wrap_rejects_mismatched_buffers(case: str) -> None:
    e = tiny()
    good = [[np.zeros(8 * PAGE, np.uint8), np.zeros(8 * PAGE, np.uint8)]]
    Memory.wrap(e, good)  # the neighbour that passes
    bad: Any = {
        "ranks": good * 2,
        "regions": [good[0][:1]],
        "size": [[np.zeros(8 * PAGE - 1, np.uint8), good[0][1]]],
        "dtype": [[np.zeros(8 * PAGE // 4, np.float32), good[0][1]]],
        "strided": [[np.zeros(16 * PAGE, np.uint8)[::2], good[0][1]]],
        "type": [[bytearray(8 * PAGE), good[0][1]]],
    }[case]
    with pytest.raises(GeometryError) as err:
        Memory.wrap(e, bad)
    assert isinstance(err.value, ValueError) and err.value.path.startswith("Memory.buffers")


def test_memory_of_another_engine_is_rejected() -> None:
    pair = tiny_pair(1, 2)
    with pytest.raises(KvGeomError):
        fill_decode(pair, tiny_request(), Memory.allocate(pair.prefill))


def test_groups_aliasing_a_shared_page_are_rejected() -> None:
    model = ModelSpec("hyb", [AttentionSpec("a", "full", num_layers=1, num_kv_heads=4, head_bytes=8),
                              AttentionSpec("b", "full", num_layers=1, num_kv_heads=4, head_bytes=8)])
    e = EngineGeometry.build(model, tp=1, kernel_block_tokens=4, num_blocks=8, regions="shared")
    pair = Pair(e, e)
    same = GroupRequest(BlockList((1,)), BlockList((1,)))
    with pytest.raises(RequestError):
        simulate(pair, Request(4, [same, same]), make_plan(1, 1, []))
    fine = fresh_request(pair, 4)
    rows = [(0, 0, g * PAGE, 0, 0, g * PAGE, PAGE) for g in range(2)]  # fresh ids: group g uses block g
    report = simulate(pair, fine, make_plan(1, 1, rows))
    assert kinds(report) == {V.NOT_MINIMAL}  # blocks 0 and 1 are adjacent on both sides: one copy would do
    assert_ok(simulate(pair, fine, make_plan(1, 1, [(0, 0, 0, 0, 0, 0, 2 * PAGE)])))


# ---- the report ------------------------------------------------------------------------------


def test_report_caps_the_listing_but_counts_everything() -> None:
    # 32 eight-byte writes into D block 3 (not listed), 16 B apart so that none could merge
    stray = [(0, L, P_IDS[0] * PAGE, 0, L, 3 * PAGE + 16 * j, 8) for L in range(2) for j in range(16)]
    report = simulate(tiny_pair(), tiny_request(), whole_plan(WHOLE + stray))
    assert report.counts[V.FOREIGN_WRITE] == 32
    assert len(report.of_kind(V.FOREIGN_WRITE)) == LIST_LIMIT
    assert len(check_plan(tiny_pair(), tiny_request(), whole_plan(WHOLE + stray))) == 32
    data = json.loads(json.dumps(report.to_dict()))
    assert data["ok"] is False and data["counts"]["foreign_write"] == 32
    assert str(report).startswith("FAILED") and "foreign_write x32" in str(report)
    assert str(simulate(tiny_pair(), tiny_request(), whole_plan())).startswith("OK")


# ---- scale -----------------------------------------------------------------------------------


def test_ten_thousand_tokens_eight_layers_tp2_to_tp4() -> None:
    """8 layers, 8 KV heads of 128 B, K = 16, HND; P TP2 (4 heads a rank), D TP4 (2 heads a rank).

    P page: 2 * 4 * 16 * 128 = 16384 B (plane 8192 B, head 2048 B); D page: 2 * 2 * 16 * 128 = 8192 B
    (plane 4096 B). D rank d reads its two heads from P rank d // 2, local heads 2 * (d % 2) and
    the next: 4096 contiguous bytes per plane. M = 10000 = 625 blocks; D also lists block 625
    (N = M + 1), which receives nothing and is zeroed whole.
    """
    model = ModelSpec("big", [AttentionSpec("full", "full", num_layers=8, num_kv_heads=8, head_bytes=128)])
    P = EngineGeometry.build(model, tp=2, kernel_block_tokens=16, num_blocks=640, name="P")
    D = EngineGeometry.build(model, tp=4, kernel_block_tokens=16, num_blocks=640, name="D")
    pair = Pair(P, D)
    M = 10_000
    req = fresh_request(pair, M, decode_tokens=M + 1)
    p_list, d_list = req.groups[0].prefill, req.groups[0].decode
    assert isinstance(p_list, BlockList) and isinstance(d_list, BlockList)
    assert p_list.block_ids == tuple(range(625)) and d_list.block_ids == tuple(range(626))
    p_page, d_page, head, n = 16384, 8192, 2048, 625
    k = np.arange(n)
    parts = []
    for d in range(4):
        for L in range(8):
            for kv in range(2):
                parts.append(np.stack([np.full(n, d // 2), np.full(n, L), k * p_page + kv * 8192 + (d % 2) * 2 * head,
                                       np.full(n, d), np.full(n, L), k * d_page + kv * 4096, np.full(n, 2 * head)]))
    rows = np.concatenate(parts, axis=1).T
    zero_rows = [(d, L, 625 * d_page, d_page) for d in range(4) for L in range(8)]
    plan = make_plan(2, 4, rows, zero_rows)
    report = simulate(pair, req, plan, replan=plan)
    assert_ok(report)
    assert report.bytes_checked == 4 * 8 * 640 * d_page
    broken = make_plan(2, 4, rows[1:], zero_rows)
    assert kinds(simulate(pair, req, broken)) == {V.MISSING}


def test_rewriting_a_held_prefix_page_is_a_foreign_write_even_with_identical_bytes() -> None:
    """D lists a block it already holds (tokens [0, S)); copying the same bytes into it again is
    invisible in memory but breaks docs/design.md §4.2 (invariant 1), so the plan-level check reports it."""
    from kvgeom import EngineGeometry, Pair, fresh_request, plan_pair

    m = ModelSpec("g", [AttentionSpec("attn", "full", 1, 2, 8)])
    e = EngineGeometry.build(m, tp=1, kernel_block_tokens=4, num_blocks=8)
    pair = Pair(e.with_name("prefill"), e.with_name("decode"))
    req = fresh_request(pair, 12, prefix_hit_tokens=4)
    # D lists from token 4 here; list the held block too (block 7 holds tokens [0, 4))
    g = req.groups[0]
    assert isinstance(g.decode, BlockList)
    req = Request(12, [GroupRequest(g.prefill, BlockList((7,) + g.decode.block_ids, 0))], 4)
    plan = plan_pair(pair, req)
    assert_ok(simulate(pair, req, plan))
    page = e.regions[0].page_bytes
    # add a copy of P's tokens [0, 4) (P block 0 = page 0) into D's held page 7
    extra = Copies([0], [0], [0], [0], [0], [7 * page], [page])
    bad = TransferPlan(1, 1, Copies.concat([plan.copies, extra]), plan.zeros)
    report = simulate(pair, req, bad)
    assert kinds(report) == {V.FOREIGN_WRITE}
    assert report.of_kind(V.FOREIGN_WRITE)[0].offset == 7 * page
