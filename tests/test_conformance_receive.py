"""The conformance kit on vLLM's full receive contract: page permutes given as rearranges, and the
policy for D tokens past M (docs/design.md §10.4).

Geometry: vLLM 0.32's LBHNC attention page, ``[head][token][K | V]``, one layer per region. 2 layers,
2 KV heads of 8 B on TP1; P blocks of 4 tokens (pages of 2 * 4 * 16 = 128 B), D blocks of 8 tokens
(256 B, ratio 2). M = 14, N = 15: P lists blocks [3, 5, 7, 9] (tokens [0, 16)), D lists [2, 4].
vLLM READs P block ``i`` into half ``i % 2`` of D block ``i // 2``, regroups each D page
(``kv_postprocess_blksize_on_receive``) and zeroes nothing (4 sub-blocks cover 2 D blocks), so D
tokens 14 and 15 receive P's uncomputed slots 2 and 3 of block 9. Every number below is derived
here from those sizes.
"""

from __future__ import annotations

import attrs
import numpy as np
import pytest

from kvgeom import AttentionSpec, EngineGeometry, ModelSpec, Pair, PlanError, ViolationKind, request_from_block_tables
from kvgeom.checking import simulate
from kvgeom.conformance import (
    ConnectorRows,
    DescriptorTable,
    Read,
    check_connector,
    page_tail_zeros,
    regroup_rearrange,
    rows_from_descriptors,
)

MODEL = ModelSpec("tiny", [AttentionSpec("full", "full", num_layers=2, num_kv_heads=2, head_bytes=8)])
P = EngineGeometry.build(MODEL, tp=1, kernel_block_tokens=4, num_blocks=12, layout="HND", kv="inner", name="prefill")
D = EngineGeometry.build(MODEL, tp=1, kernel_block_tokens=8, num_blocks=6, layout="HND", kv="inner", name="decode")
PAIR = Pair(P, D)
M, N = 14, 15
P_BLOCKS, D_BLOCKS = [3, 5, 7, 9], [2, 4]
REQUEST = request_from_block_tables(PAIR, M, [P_BLOCKS], [D_BLOCKS], decode_tokens=N)
CELL = 2 * 8  # K | V of one (head, token)
P_PAGE, D_PAGE = 2 * 4 * CELL, 2 * 8 * CELL
P_BASES = [[0x10000, 0x20000]]
D_BASES = [[0x100000, 0x200000]]


def test_geometry_is_the_lbhnc_page() -> None:
    assert (P.regions[0].page_bytes, D.regions[0].page_bytes) == (P_PAGE, D_PAGE) == (128, 256)
    layout = D.groups[0].layout  # type: ignore[union-attr]
    assert (layout.kv_stride, layout.head_stride, layout.token_stride) == (8, 8 * CELL, CELL)


def vllm_read() -> Read:
    """vLLM's local descriptors: every D page cut into 2 sub-blocks of a P page; READ i pairs P block i."""
    local = DescriptorTable([b + k * P_PAGE for b in D_BASES[0] for k in range(6 * 2)], [P_PAGE] * 24)
    remote = DescriptorTable([b + k * P_PAGE for b in P_BASES[0] for k in range(12)], [P_PAGE] * 24)
    sub = [d * 2 + s for d in D_BLOCKS for s in range(2)]
    assert sub == [4, 5, 8, 9]
    return Read(0, 0, local, [r * 12 + k for r in range(2) for k in sub],
                remote, [r * 12 + k for r in range(2) for k in P_BLOCKS])


def regroups(order: str = "LBHNC") -> list:
    return [regroup_rearrange(0, r, D_BLOCKS, heads=2, tokens=8, cell_bytes=CELL, ratio=2, page_bytes=D_PAGE,
                              local_order=order) for r in range(2)]


def tail_zeros() -> list[tuple[int, int, int]]:
    """Tokens 14 and 15 (slots 6, 7 of D block 4) of every head, in the final LBHNC page: 2 cells per head."""
    out = [(0, base + 4 * D_PAGE + h * 8 * CELL + 6 * CELL, 2 * CELL) for base in D_BASES[0] for h in range(2)]
    assert out == [z for base in D_BASES[0] for z in page_tail_zeros(0, base + 4 * D_PAGE, heads=2, tokens=8,
                                                                     cell_bytes=CELL, from_token=6)]
    return out


def test_regroup_rearrange_arithmetic() -> None:
    """The module's worked number: P block 1, head 0, token 2 arrives at 160 and moves to D token 6 at 96."""
    (r,) = regroups()[:1]
    assert (r.shape, r.src_strides, r.dst_strides, r.unit_bytes) == ((2, 2, 4), (128, 64, 16), (64, 128, 16), 16)
    assert 1 * 128 + 0 * 64 + 2 * 16 == 160 and 1 * 64 + 0 * 128 + 2 * 16 == 96
    nhd = regroup_rearrange(0, 0, [2], heads=2, tokens=8, cell_bytes=CELL, ratio=2, page_bytes=D_PAGE,
                            local_order="LBNHC")
    assert nhd.dst_strides == (4 * 2 * CELL, CELL, 2 * CELL)  # token j*4 + t of head h at ((j*4 + t)*2 + h) * 16


def test_permute_as_a_rearrange_passes_and_the_tail_is_its_own_kind() -> None:
    rows, unresolved = rows_from_descriptors(PAIR, prefill_bases=P_BASES, decode_bases=D_BASES, reads=[vllm_read()],
                                             rearranges=regroups())
    assert not unresolved and len(rows.copies) == 8 and len(rows.rearranges) == 2
    masked = check_connector(PAIR, REQUEST, rows, beyond_computed="any")
    assert masked.ok and masked.beyond_computed == "any", str(masked)
    assert "beyond_computed x4" in str(masked) and "beyond_computed='any'" in str(masked)
    # the tail vLLM leaves: tokens 14, 15 of both heads and both layers = 2 regions x 2 heads x 2 cells
    assert masked.ignored[ViolationKind.BEYOND_COMPUTED] == 4
    assert masked.report.bytes_bad[ViolationKind.BEYOND_COMPUTED] <= 4 * 2 * CELL
    strict = check_connector(PAIR, REQUEST, rows)  # kvgeom's contract: the tail must be zero
    assert set(strict.counts) == {ViolationKind.BEYOND_COMPUTED} and not strict.ok
    got = sorted((v.region, v.offset, v.nbytes, v.tokens) for v in strict.of_kind(ViolationKind.BEYOND_COMPUTED))
    assert got == [(r, 4 * D_PAGE + h * 8 * CELL + 6 * CELL, 2 * CELL, (14, 15)) for r in range(2) for h in range(2)]
    assert ViolationKind.WRONG_DATA not in strict.counts
    # zeroing the tail in the final layout satisfies "zero" too
    zeroed, _ = rows_from_descriptors(PAIR, prefill_bases=P_BASES, decode_bases=D_BASES, reads=[vllm_read()],
                                      rearranges=regroups(), zeros=tail_zeros())
    assert check_connector(PAIR, REQUEST, zeroed).ok


def test_controls_each_break_the_check() -> None:
    # no permute: the arrived sub-blocks sit where other tokens belong
    raw, _ = rows_from_descriptors(PAIR, prefill_bases=P_BASES, decode_bases=D_BASES, reads=[vllm_read()])
    bad = check_connector(PAIR, REQUEST, raw, beyond_computed="any")
    assert not bad.ok and ViolationKind.WRONG_DATA in bad.counts
    # the permute of the other page order
    wrong, _ = rows_from_descriptors(PAIR, prefill_bases=P_BASES, decode_bases=D_BASES, reads=[vllm_read()],
                                     rearranges=regroups("LBNHC"))
    assert ViolationKind.WRONG_DATA in check_connector(PAIR, REQUEST, wrong, beyond_computed="any").counts
    # "any" masks only the tail: a READ shifted by one P block is still WRONG_DATA before M
    read = vllm_read()
    shifted = Read(0, 0, read.local, read.local_ids, read.remote, np.roll(read.remote_ids, 1))
    rows, _ = rows_from_descriptors(PAIR, prefill_bases=P_BASES, decode_bases=D_BASES, reads=[shifted],
                                    rearranges=regroups())
    report = check_connector(PAIR, REQUEST, rows, beyond_computed="any")
    assert ViolationKind.WRONG_DATA in report.counts and not report.ok
    # a dropped tail zero is NOT_ZEROED under "zero" (stale bytes), ignored under "any"
    some, _ = rows_from_descriptors(PAIR, prefill_bases=P_BASES, decode_bases=D_BASES, reads=[vllm_read()],
                                    rearranges=regroups(), zeros=tail_zeros()[1:])
    assert set(check_connector(PAIR, REQUEST, some).counts) == {ViolationKind.BEYOND_COMPUTED}  # P's garbage stays
    assert check_connector(PAIR, REQUEST, some, beyond_computed="any").ok


def test_stale_tail_is_not_zeroed_under_zero_and_ignored_under_any() -> None:
    """kvgeom's own plan with its tail zeros dropped: the tail keeps D's stale pattern."""
    plan = PAIR.plan(REQUEST)
    assert len(plan.zeros) and not plan.rearranges
    bare = attrs.evolve(plan, zeros=plan.zeros.take(np.zeros(len(plan.zeros), bool)))
    assert set(simulate(PAIR, REQUEST, bare).counts) == {ViolationKind.NOT_ZEROED}
    lenient = simulate(PAIR, REQUEST, bare, beyond_computed="any")
    assert set(lenient.counts) == {ViolationKind.BEYOND_COMPUTED}  # the caller weighs it (the kit ignores it)
    assert simulate(PAIR, REQUEST, plan).ok and simulate(PAIR, REQUEST, plan, beyond_computed="any").ok


def test_bad_arguments_are_typed_errors() -> None:
    rows, _ = rows_from_descriptors(PAIR, prefill_bases=P_BASES, decode_bases=D_BASES, reads=[vllm_read()])
    for policy in ("maybe", None, 0):
        with pytest.raises(PlanError, match="beyond_computed"):
            check_connector(PAIR, REQUEST, rows, beyond_computed=policy)  # type: ignore[arg-type]
    with pytest.raises(PlanError, match="beyond_computed"):
        simulate(PAIR, REQUEST, PAIR.plan(REQUEST), beyond_computed="none")
    with pytest.raises(PlanError, match="ratio"):
        regroup_rearrange(0, 0, [2], heads=2, tokens=8, cell_bytes=CELL, ratio=3, page_bytes=D_PAGE)
    with pytest.raises(PlanError, match="local_order"):
        regroup_rearrange(0, 0, [2], heads=2, tokens=8, cell_bytes=CELL, ratio=2, page_bytes=D_PAGE, local_order="HND")
    with pytest.raises(PlanError, match="page_bytes"):
        regroup_rearrange(0, 0, [2], heads=2, tokens=8, cell_bytes=CELL, ratio=2, page_bytes=D_PAGE, offset=8)
    assert page_tail_zeros(0, 1000, heads=2, tokens=8, cell_bytes=CELL, from_token=6, local_order="LBNHC") == [
        (0, 1000 + 6 * 2 * CELL, 2 * 2 * CELL)]  # token-major: tokens 6, 7 of both heads are one range
    assert page_tail_zeros(0, 1000, heads=2, tokens=8, cell_bytes=CELL, from_token=8) == []
    with pytest.raises(PlanError, match="local_order"):
        page_tail_zeros(0, 0, heads=2, tokens=8, cell_bytes=CELL, from_token=6, local_order="HND")
    with pytest.raises(PlanError, match="rearranges"):
        rows_from_descriptors(PAIR, prefill_bases=P_BASES, decode_bases=D_BASES, reads=[vllm_read()],
                              rearranges="LBHNC")  # type: ignore[arg-type]


def test_a_per_plane_finding_names_the_tokens_its_bytes_hold() -> None:
    """On vLLM's CPU_ATTN page (design §3.5: K transposed, element d of token s at d * 32 + s) a wrong
    byte range's first byte need not hold its first token. 32-token pages, 2 heads of 32 float32 (a
    K plane of 4096 B per head), one layer, one block: a connector copies P's page whole, except
    bytes [20, 140) of head 0's K, read from the wrong P page. Those are K elements 5..34: dim 0 of
    tokens 5..31 and dim 1 of tokens 0..2, so the finding covers tokens 0..31 (by the first and last
    bytes alone it would read "tokens 5..2")."""
    model = ModelSpec("cpu", [AttentionSpec("attn", "full", num_layers=1, num_kv_heads=2, head_bytes=128)],
                      dtype="float32")
    p = EngineGeometry.build(model, tp=1, kernel_block_tokens=32, num_blocks=4, layout="CPU_ATTN", name="prefill")
    d = EngineGeometry.build(model, tp=1, kernel_block_tokens=32, num_blocks=4, layout="CPU_ATTN", name="decode")
    pair = Pair(p, d)
    request = request_from_block_tables(pair, 32, [[1]], [[2]])
    page = p.regions[0].page_bytes
    assert page == 2 * 2 * 32 * 128
    good = [(0, 0, page, 0, 0, 2 * page, page)]
    bad = [(0, 0, page, 0, 0, 2 * page, 20), (0, 0, 3 * page + 20, 0, 0, 2 * page + 20, 120),
           (0, 0, page + 140, 0, 0, 2 * page + 140, page - 140)]
    assert check_connector(pair, request, ConnectorRows.from_rows(good)).ok
    report = check_connector(pair, request, ConnectorRows.from_rows(bad))
    wrong = report.of_kind(ViolationKind.WRONG_DATA)
    assert [(v.offset, v.nbytes, v.block, v.layer, v.tokens, v.rows) for v in wrong] == [
        (2 * page + 20, 120, 2, 0, (0, 31), ("descriptor 1",))]
    assert "tokens 0..31" in str(wrong[0])
