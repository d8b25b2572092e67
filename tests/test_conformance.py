"""The conformance kit: a connector's own descriptors checked by the simulator, reported in its terms.

The main case is a model of vLLM's NIXL connector before #49612 on the geometry of its harness
(docs/design.md §9, E5): D blocks of 24 tokens in 8-token kernel pages (ppl 3), P blocks of 8 tokens
in 4-token pages (ppl 2), MLA-like latents of 12 B, two layers in two regions, N = 29 (M = 28).
Every number below is derived here by hand from those sizes.
"""

from __future__ import annotations

import numpy as np
import pytest

from kvgeom import AttentionSpec, EngineGeometry, ModelSpec, Pair, PlanError, ViolationKind, request_from_block_tables
from kvgeom.conformance import ConnectorRows, DescriptorTable, Read, check_connector, rows_from_descriptors

MODEL = ModelSpec("mla-12B", [AttentionSpec("mla", "mla", num_layers=2, num_kv_heads=1, head_bytes=12)])
P = EngineGeometry.build(MODEL, tp=2, kernel_block_tokens=4, blocks_per_logical=2, num_blocks=12, name="prefill")
D = EngineGeometry.build(MODEL, tp=1, kernel_block_tokens=8, blocks_per_logical=3, num_blocks=8, name="decode")
PAIR = Pair(P, D)
REQUEST = request_from_block_tables(PAIR, 28, [[2, 4, 6, 8]], [[1, 3]], decode_tokens=29)

D_PAGE = 8 * 12  # 96 B: a D kernel page of 8 latents
P_PAGE = 4 * 12  # 48 B: a P kernel page, and vLLM's local sub-descriptor (D page / block size ratio 2)
D_BASES = [[0x100000, 0x200000]]  # per D rank, per region (the handshake's kv_caches_base_addr)
P_BASES = [[0x10000000, 0x20000000], [0x30000000, 0x40000000]]


def vllm_read() -> Read:
    """The READ vLLM posts: local kernel pages of D blocks [1, 3] (ppl 3) cut into 2 sub-descriptors
    each, clipped to the 8 remote pages of P blocks [2, 4, 6, 8] (ppl 2), paired positionally."""
    local = DescriptorTable([b + k * P_PAGE for b in D_BASES[0] for k in range(24 * 2)], [P_PAGE] * 96)
    remote = DescriptorTable([b + k * P_PAGE for b in P_BASES[0] for k in range(24)], [P_PAGE] * 48)
    local_kernel = [b * 3 + j for b in (1, 3) for j in range(3)]
    assert local_kernel == [3, 4, 5, 9, 10, 11]
    sub = [k * 2 + s for k in local_kernel for s in range(2)][:8]
    assert sub == [6, 7, 8, 9, 10, 11, 18, 19]
    remote_kernel = [b * 2 + j for b in (2, 4, 6, 8) for j in range(2)]
    assert remote_kernel == [4, 5, 8, 9, 12, 13, 16, 17]
    return Read(0, 0, local, [r * 48 + k for r in range(2) for k in sub],
                remote, [r * 24 + k for r in range(2) for k in remote_kernel])


def test_vllm_pre_fix_stale_tail_is_caught_in_vllm_terms() -> None:
    rows, unresolved = rows_from_descriptors(PAIR, prefill_bases=P_BASES, decode_bases=D_BASES, reads=[vllm_read()])
    assert not unresolved and len(rows.copies) == 16  # 8 pairs per region
    report = check_connector(PAIR, REQUEST, rows)  # pre-fix: nothing zeroed (covered = 8 = 4 * 2, no partial tail)
    assert not report.ok
    # 8 remote pages of 4 tokens cover tokens [0, 32); D block 3 (tokens [24, 48)) is kernel pages 9, 10, 11,
    # so pages 10 and 11 (tokens 32..47) receive nothing: 2 * 96 = 192 stale bytes per region
    stale = report.of_kind(ViolationKind.NOT_ZEROED)
    assert [(v.region, v.offset, v.nbytes) for v in stale] == [(r, 10 * D_PAGE, 2 * D_PAGE) for r in range(2)]
    assert 2 * D_PAGE == 192
    for r, v in enumerate(stale):
        assert (v.block, v.tokens, v.layer, v.group, v.rows) == (3, (32, 47), r, "mla", ())
    # and vLLM copies whole P pages: P page 17 (P block 8, tokens 28..31) was never computed (M = 28), so
    # D page 9 slots 4..7 receive P's garbage where kvgeom wants zeros: 4 tokens * 12 B = 48 B per region,
    # reported as its own kind (the tail past M), never as WRONG_DATA
    tail = report.of_kind(ViolationKind.BEYOND_COMPUTED)
    assert [(v.offset, v.nbytes, v.tokens) for v in tail] == [(9 * D_PAGE + 4 * 12, 48, (28, 31))] * 2
    assert tail[0].rows == ("read 0 local 19 remote 17",) and tail[1].rows == ("read 0 local 67 remote 41",)
    assert set(report.counts) == {ViolationKind.NOT_ZEROED, ViolationKind.BEYOND_COMPUTED}
    assert report.ignored == {ViolationKind.NOT_MINIMAL: report.report.counts[ViolationKind.NOT_MINIMAL]}
    assert "not_zeroed: decode rank 0 region 1 bytes [960, 1152): mla layer 1 block 3 tokens 32..47" in str(report)


def test_vllm_post_fix_zeroing_clears_the_stale_pages() -> None:
    """#49612's rule zeroes the untransferred whole blocks G[4:] = kernel pages 10 and 11."""
    zeros = [(0, base + 10 * D_PAGE, 2 * D_PAGE) for base in D_BASES[0]]
    rows, _ = rows_from_descriptors(PAIR, prefill_bases=P_BASES, decode_bases=D_BASES, reads=[vllm_read()],
                                    zeros=zeros)
    report = check_connector(PAIR, REQUEST, rows)
    assert set(report.counts) == {ViolationKind.BEYOND_COMPUTED}  # only P's uncomputed tokens 28..31 remain
    # an engine whose attention masks by length (vLLM's) holds no contract on them: the same rows conform
    masked = check_connector(PAIR, REQUEST, rows, beyond_computed="any")
    assert masked.ok and masked.ignored[ViolationKind.BEYOND_COMPUTED] == 2


def test_under_any_the_pre_fix_tail_is_masked_but_wrong_bytes_are_not() -> None:
    """Pre-fix, everything vLLM got wrong lies at or past M = 28 (stale pages 10, 11 and P's tokens 28..31):
    under "any" it conforms. Control: the same READ with two remote ids swapped puts P tokens 0..3 at D
    tokens 4..7 (before M), WRONG_DATA under either policy."""
    rows, _ = rows_from_descriptors(PAIR, prefill_bases=P_BASES, decode_bases=D_BASES, reads=[vllm_read()])
    masked = check_connector(PAIR, REQUEST, rows, beyond_computed="any")
    assert masked.ok and set(masked.ignored) == {ViolationKind.NOT_MINIMAL, ViolationKind.BEYOND_COMPUTED}
    read = vllm_read()
    ids = read.remote_ids.copy()
    ids[[0, 1]] = ids[[1, 0]]
    swapped = Read(0, 0, read.local, read.local_ids, read.remote, ids)
    rows, _ = rows_from_descriptors(PAIR, prefill_bases=P_BASES, decode_bases=D_BASES, reads=[swapped])
    for policy in ("zero", "any"):
        wrong = check_connector(PAIR, REQUEST, rows, beyond_computed=policy).of_kind(ViolationKind.WRONG_DATA)
        assert wrong and wrong[0].tokens == (0, 7) and wrong[0].region == 0


def test_kvgeoms_own_plan_conforms() -> None:
    report = check_connector(PAIR, REQUEST, ConnectorRows.from_plan(PAIR.plan(REQUEST)))
    assert report.ok and not report.ignored and report.report.bytes_checked == 2 * 24 * D_PAGE


def test_rows_in_kvgeom_units_name_their_ids() -> None:
    plan = PAIR.plan(REQUEST)
    copies = plan.copies.as_array()
    zeros = plan.zeros.as_array()
    # drop the copy of region 1's first run: D bytes it wrote are MISSING, named by block and tokens
    kept = [i for i in range(len(copies)) if not (copies[i, 4] == 1 and copies[i, 5] == copies[copies[:, 4] == 1, 5].min())]
    rows = ConnectorRows.from_rows(copies[kept], zeros, copy_ids=np.array(kept) + 100)
    report = check_connector(PAIR, REQUEST, rows)
    missing = report.of_kind(ViolationKind.MISSING)
    assert missing and all(v.region == 1 and v.rows == () for v in missing)
    assert missing[0].block == 1 and missing[0].tokens is not None and missing[0].tokens[0] == 0
    # shift a copy into D block 0, which the request does not list: FOREIGN_WRITE names the row's id
    moved = copies.copy()
    moved[0, 5] = 0
    report = check_connector(PAIR, REQUEST, ConnectorRows.from_rows(moved, zeros, copy_ids=np.arange(len(moved)) + 7))
    foreign = report.of_kind(ViolationKind.FOREIGN_WRITE)
    assert foreign and foreign[0].rows[0] == "descriptor 7" and foreign[0].block == 0 and foreign[0].tokens is None


def test_descriptors_outside_the_regions_and_malformed_pairs() -> None:
    read = vllm_read()
    far = DescriptorTable(np.append(read.local.addresses, 0x900000), np.append(read.local.lengths, P_PAGE))
    out = Read(0, 0, far, np.append(read.local_ids, 96), read.remote, np.append(read.remote_ids, 4))
    rows, unresolved = rows_from_descriptors(PAIR, prefill_bases=P_BASES, decode_bases=D_BASES, reads=[out])
    assert [(u.side, u.address, u.label) for u in unresolved] == [("decode", 0x900000, "read 0 local 96 remote 4")]
    report = check_connector(PAIR, REQUEST, rows, unresolved=unresolved)
    assert report.counts[ViolationKind.OUT_OF_BOUNDS] == 1 and report.of_kind(ViolationKind.OUT_OF_BOUNDS)[0].rows
    short = DescriptorTable(read.local.addresses, np.where(np.arange(96) == 6, 24, P_PAGE))
    with pytest.raises(PlanError, match="local descriptor 6 has 24 B, remote descriptor 4 has 48 B"):
        rows_from_descriptors(PAIR, prefill_bases=P_BASES, decode_bases=D_BASES,
                              reads=[Read(0, 0, short, read.local_ids, read.remote, read.remote_ids)])
    with pytest.raises(PlanError, match="base addresses of shape"):
        rows_from_descriptors(PAIR, prefill_bases=P_BASES[:1], decode_bases=D_BASES, reads=[read])


def test_minimality_is_held_against_the_connector_only_on_request() -> None:
    rows, _ = rows_from_descriptors(PAIR, prefill_bases=P_BASES, decode_bases=D_BASES, reads=[vllm_read()],
                                    zeros=[(0, b + 9 * D_PAGE + 48, 48 + 2 * D_PAGE) for b in D_BASES[0]])
    lenient = check_connector(PAIR, REQUEST, rows)
    strict = check_connector(PAIR, REQUEST, rows, require_minimal=True)
    assert lenient.ok and ViolationKind.NOT_MINIMAL in lenient.ignored  # zeroing tokens 28..47 fixes both findings
    assert ViolationKind.NOT_MINIMAL in strict.counts and not strict.ok
    # sub-descriptors 6 and 7 are adjacent on both sides (D page 3, P pages 4 and 5 of block 2): mergeable
    assert strict.of_kind(ViolationKind.NOT_MINIMAL)[0].rows[0] == "read 0 local 6 remote 4"
