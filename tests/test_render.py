"""Text and HTML renderings show the numbers that matter, computed here by hand.

Plans are built by hand (no planner involved) so the expected per-rank sums are plain arithmetic.
"""

from __future__ import annotations

import re

import numpy as np

from kvgeom import (
    AttentionSpec,
    Copies,
    EngineGeometry,
    ModelSpec,
    Pair,
    Rearrange,
    StateSection,
    StateSpec,
    TransferPlan,
    Zeros,
    fresh_request,
)
from kvgeom.values import (
    engine_html,
    engine_line,
    engine_repr,
    format_bytes,
    format_ids,
    plan_html,
    plan_pair_bytes,
    plan_rank_rows,
    plan_repr,
    request_html,
    request_repr,
    text_table,
)

MODEL = ModelSpec("toy", (AttentionSpec("attn", "full", 2, 8, 256),))


def _engine(tp: int = 4, layout: str = "HND", name: str = "decode", kv: str = "packed") -> EngineGeometry:
    return EngineGeometry.build(MODEL, tp=tp, kernel_block_tokens=8, num_blocks=6, layout=layout,  # type: ignore[arg-type]
                                kv=kv, name=name)  # type: ignore[arg-type]


def _plan(prefill_tp: int = 2, decode_tp: int = 2, notes: tuple[str, ...] = ("strategy direct",)) -> TransferPlan:
    # D0 <- P0 100 B and P1 50 B; D1 <- P1 25 B; D1 zeroes 10 B; one rearrange of 3 pages on D1
    copies = Copies(p_rank=[0, 1, 1], p_region=[0, 0, 0], p_offset=[0, 100, 300], d_rank=[0, 0, 1],
                    d_region=[0, 0, 0], d_offset=[0, 100, 0], nbytes=[100, 50, 25])
    zeros = Zeros(d_rank=[1], d_region=[0], d_offset=[25], nbytes=[10])
    rearr = Rearrange(d_rank=1, d_region=0, pages=(0, 1, 2), shape=(2, 2), src_strides=(8, 16), dst_strides=(16, 8),
                      unit_bytes=8, page_bytes=64)
    return TransferPlan(prefill_tp, decode_tp, copies, zeros, (rearr,), notes, copies_before_coalescing=5)


def test_format_helpers() -> None:
    assert format_ids((1, 2, 3, 4, 7)) == "1..4, 7"
    assert format_ids(()) == "-"
    assert format_ids(tuple(range(0, 40, 2)), limit=3) == "0, 2, ... 38 (20 ids)"
    assert format_bytes(1000) == "1,000 B"
    assert format_bytes(3 * 1024 * 1024) == "3,145,728 B (3.0 MiB)"
    table = text_table([["name", "n"], ["a", 5], ["bb", 1234]], indent="")
    assert table.splitlines() == ["name      n", "a         5", "bb    1,234"]


def test_engine_line_and_repr() -> None:
    e = _engine()
    assert engine_line(e) == ("decode: toy TP4 K=8 ppl=1 (logical 8 tok) [attn:full/HND packed] 2 regions")
    text = repr(e)
    assert text == engine_repr(e)
    assert "TP4, kernel 8 tok x ppl 1 = logical 8 tok" in text
    # HND packed, 2 local heads: head stride 8 tokens * 256 B = 2048, K/V stride 2 * 2048 = 4096
    assert "4096/2048/256" in text
    # two regions of 6 pages x (2 planes * 2 heads * 8 tokens * 256 B = 8192 B)
    assert re.search(r"r0\.\.r1\s+6\s+8,192\s+49,152", text)
    # rank 3 of TP4 holds heads [6, 8)
    assert re.search(r"^\s+3\s+\[6, 8\)$", text, re.M)
    nhd = _engine(layout="NHD", kv="split", name="prefill")
    assert "attn:full/NHD split" in engine_line(nhd)


def test_state_engine_repr_lists_sections() -> None:
    model = ModelSpec("hyb", (AttentionSpec("attn", "full", 1, 4, 64),
                              StateSpec("mamba", 1, (StateSection("x", channels=16, unit_bytes=2, rows=3),
                                                     StateSection("ssm", channels=4, unit_bytes=128)))))
    e = EngineGeometry.build(model, tp=2, kernel_block_tokens=4, blocks_per_logical=2, num_blocks=3,
                             regions="shared", name="p")
    text = repr(e)
    # per rank: x 8 channels x 3 rows x 2 B = 48 B at offset 0, ssm 2 heads x 128 B at 48: 304 B per layer
    assert re.search(r"x\s+16\s+8\s+3\s+2\s+0\s+6\s+2\s+sharded", text)
    assert re.search(r"ssm\s+4\s+2\s+1\s+128\s+48\s+128\s+128\s+sharded", text)
    assert re.search(r"mamba\s+state\s+1\s+2 sections\s+304", text)
    assert "mamba.x" in text and "[8, 16)" in text  # rank 1's slice of x


def test_engine_html_escapes() -> None:
    e = _engine(name="<d&1>")
    out = engine_html(e)
    assert out == e._repr_html_()
    assert "<table" in out and "&lt;d&amp;1&gt;" in out and "<d&1>" not in out
    assert "8,192" in out and "[6, 8)" in out


def test_request_repr_with_and_without_pair() -> None:
    pair = Pair(_engine(tp=2, name="prefill"), _engine())
    request = fresh_request(pair, 30, prefix_hit_tokens=8, decode_first_block=2)
    bare = repr(request)
    assert bare.startswith("Request: M=30 computed tokens, S=8 prefix-hit tokens, 1 group")
    assert re.search(r"g0\s+decode\s+2\.\.4\s+3\s+from 8", bare)  # [8, 30) in 8-token blocks: ids 2, 3, 4
    full = request_repr(request, pair)
    assert re.search(r"attn\s+prefill\s+0\.\.3\s+4\s+\[0, 32\)", full)
    assert re.search(r"attn\s+decode\s+2\.\.4\s+3\s+\[8, 32\)", full)
    html = request_html(request, pair)
    assert "[8, 32)" in html and "<table" in html


def test_plan_rank_rows_and_pair_bytes() -> None:
    plan = _plan()
    rows = plan_rank_rows(plan)
    assert rows[1] == [0, "0..1", 2, 150, 0, 0, 0]
    assert rows[2] == [1, "1", 1, 25, 1, 10, 3]
    assert plan_pair_bytes(plan) == {(0, 0): 100, (1, 0): 50, (1, 1): 25}


def test_plan_repr_and_html() -> None:
    plan = _plan(notes=("strategy direct", "a <note> & more"))
    text = repr(plan)
    assert text == plan_repr(plan)
    assert text.startswith("TransferPlan P TP2 -> D TP2")
    assert "copies: 3 (5 before coalescing), 175 B" in text
    assert "zeros: 1 ranges, 10 B; rearranges: 1 (3 pages)" in text
    assert re.search(r"P1\s+50\s+25", text)  # matrix row: P1 -> D0 50 B, P1 -> D1 25 B
    assert "- a <note> & more" in text
    out = plan_html(plan)
    assert out == plan._repr_html_()
    assert "a &lt;note&gt; &amp; more" in out and "<note>" not in out
    assert "150" in out and "175 B" in out


def test_large_tp_plan_lists_pairs_and_cuts_rows() -> None:
    n = 32
    copies = Copies(p_rank=np.arange(n), p_region=np.zeros(n, np.int64), p_offset=np.zeros(n, np.int64), d_rank=np.arange(n),
                    d_region=np.zeros(n, np.int64), d_offset=np.zeros(n, np.int64), nbytes=np.full(n, 7))
    plan = TransferPlan(n, n, copies, Zeros.empty())
    text = repr(plan)
    assert "... 16 more" in text  # 32 D ranks, 16 shown
    assert re.search(r"^\s+31\s+31\s+7$", text, re.M) is None  # cut
    assert re.search(r"^\s+15\s+15\s+7$", text, re.M)  # P rank, D rank, bytes list form
