"""kvgeom.show.drawing: the cells (where every drawn coordinate comes from, by arithmetic on small cases), the
figure (rows, patches, legend) at 128 tokens and aggregated at 100k tokens, and svg/png files."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytest.importorskip("matplotlib", reason="kvgeom.show.drawing needs the notebook extra (matplotlib)")

import matplotlib  # noqa: E402

matplotlib.use("Agg")

from matplotlib.collections import PatchCollection  # noqa: E402

from kvgeom import (  # noqa: E402
    AttentionSpec,
    BlockList,
    EngineGeometry,
    GroupRequest,
    ModelSpec,
    Pair,
    Request,
    StateSection,
    StateSpec,
    fresh_request,
)
from kvgeom.show import (  # noqa: E402
    NOT_LISTED,
    SEVERAL,
    SOURCE_STRIDE,
    UNTOUCHED,
    ZEROED,
    DrawError,
    draw,
    save,
    transfer_cells,
)

S = SOURCE_STRIDE


def gqa(heads: int = 4, layers: int = 1, head_bytes: int = 8) -> ModelSpec:
    return ModelSpec("gqa", [AttentionSpec("attn", "full", layers, heads, head_bytes)])


def tp2_to_tp1(M: int, d_blocks: int, *, prefix: int = 0, **d: Any) -> tuple[Pair, Request]:
    """P TP2 K=4 -> D TP1 K=8, 4 heads; P lists ceil(M/4) consecutive blocks from 1, D d_blocks from 2."""
    P = EngineGeometry.build(gqa(), tp=2, kernel_block_tokens=4, num_blocks=64, layout="NHD", name="prefill")
    D = EngineGeometry.build(gqa(), tp=1, kernel_block_tokens=8, num_blocks=32, name="decode", **d)
    req = Request(M, [GroupRequest(BlockList.consecutive(1, -(-M // 4)), BlockList.consecutive(2, d_blocks))],
                  prefix)
    return Pair(P, D), req


def patches(fig: Any) -> list[int]:
    return [len(c.get_paths()) for c in fig.axes[0].collections if isinstance(c, PatchCollection)]


def test_decode_cells_at_128_tokens_by_arithmetic() -> None:
    # M = 120 of 128 listed D tokens (16 D blocks of 8): D rank 0 holds all 4 heads; heads 0-1 come from
    # P rank 0 and heads 2-3 from P rank 1; token t comes from P block position t // 4; 120..127 are zeroed
    pair, req = tp2_to_tp1(120, 16)
    plan = pair.plan(req)
    cm = transfer_cells(plan, pair, req)
    assert (cm.token_lo, cm.token_hi, cm.tokens_per_cell, cm.cells) == (0, 128, 1, 128)
    assert [r.label for r in cm.rows] == ["d0 attn L0 K,V h0-1", "d0 attn L0 K,V h2-3"]
    t = np.arange(128)
    for p_rank, row in enumerate(cm.rows):
        want = np.where(t < 120, p_rank * S + t // 4, ZEROED)
        np.testing.assert_array_equal(row.codes, want)
        np.testing.assert_array_equal(row.zero_fraction, (t >= 120).astype(float))
    assert cm.ranks() == [0, 1]


def test_figure_at_128_tokens_has_one_patch_per_run_and_a_legend() -> None:
    pair, req = tp2_to_tp1(120, 16)
    fig = draw(pair.plan(req), pair, req)
    ax = fig.axes[0]
    assert [t.get_text() for t in ax.get_yticklabels()] == ["d0 attn L0 K,V h0-1", "d0 attn L0 K,V h2-3"]
    # per row: 30 runs of one P block (tokens 4k..4k+3), then one zeroed run of tokens 120..127
    assert patches(fig) == [2 * 30, 2]
    assert [t.get_text() for t in ax.get_legend().get_texts()] == ["P rank 0", "P rank 1", "zeroed", "untouched"]
    assert ax.get_xlim() == (0.0, 128.0)


def test_prefix_tokens_are_untouched_and_unlisted_tokens_are_not_drawn() -> None:
    # D lists blocks 2, 3, 4 (tokens [0, 24)) with a 16-token prefix hit: tokens 0..15 untouched, 16..19
    # from P block position 4 (tokens 16..19), 20..23 zeroed; M = 20
    pair, req = tp2_to_tp1(20, 3, prefix=16)
    cm = transfer_cells(pair.plan(req), pair, req)
    t = np.arange(24)
    want = np.select([t < 16, t < 20], [UNTOUCHED, 4], ZEROED)
    np.testing.assert_array_equal(cm.rows[0].codes, want)
    np.testing.assert_array_equal(cm.rows[1].codes, np.where(want >= 0, S + want, want))
    fig = draw(pair.plan(req), pair, req)
    assert patches(fig) == [2, 2, 2]  # fills, zeroed, untouched: one run each per row
    # a sliding group listing only its tail: cells before its first token are NOT_LISTED
    model = ModelSpec("swa", [AttentionSpec("full", "full", 1, 2, 4),
                              AttentionSpec("win", "sliding", 1, 2, 4, window_tokens=8)])
    P = EngineGeometry.build(model, tp=1, kernel_block_tokens=4, num_blocks=32, name="prefill")
    D = EngineGeometry.build(model, tp=1, kernel_block_tokens=4, num_blocks=32, name="decode")
    swa = Pair(P, D)
    req = fresh_request(swa, 30)  # the window group lists tokens [20, 32) on both sides
    cm = transfer_cells(swa.plan(req), swa, req)
    win = [r for r in cm.rows if r.group == 1][0]
    # window_start(30, 8) = 30 - 8 + 1 = 23: listed tokens 20..22 lie before the window and are zeroed
    assert (win.codes[:20] == NOT_LISTED).all() and (win.codes[20:23] == ZEROED).all()
    assert (win.codes[23:30] >= 0).all() and (win.codes[30:] == ZEROED).all()


def test_staged_plans_draw_the_same_cells_as_direct_ones() -> None:
    # NHD P pages land whole in HND D pages and are rearranged: mapping back through the rearrange must
    # find the same source for every coordinate (a full-block request: 64 tokens = 8 D blocks)
    pair, req = tp2_to_tp1(64, 8)
    direct, staged = pair.plan(req, strategy="direct"), pair.plan(req, strategy="staged")
    assert staged.rearranges and not direct.rearranges
    a, b = transfer_cells(direct, pair, req), transfer_cells(staged, pair, req)
    assert [r.label for r in a.rows] == [r.label for r in b.rows]
    for x, y in zip(a.rows, b.rows):
        np.testing.assert_array_equal(x.codes, y.codes)


@pytest.mark.parametrize("preset", ["gqa-tp2-tp4", "llama3-70b-tp8-tp4", "nemotron-h-tp1-tp4", "llama3-70b-pp2tp4-tp8",
                                    "deepseek-v3-dcp4-dcp2", "kimi-linear-pp2tp4-tp1"])
def test_packed_plans_draw_the_same_cells_as_direct_ones(preset: str) -> None:
    """Mapping a D byte back through its unpack, the D slot, the wire row, the P slot and its pack must
    find the P block a direct copy reads (and the prefill view the same reading D ranks), in chunks too."""
    from kvgeom import min_staging_bytes
    from kvgeom.building import get_preset

    pair, req = get_preset(preset).build(100, 0, layers=2)
    direct = pair.plan(req, strategy="direct")
    one = pair.plan(req, strategy="packed")
    busiest = max(int(one.staging_used(side).max()) for side in ("prefill", "decode"))
    for capacity in (busiest, max(min_staging_bytes(pair, req), busiest // 3)):  # one chunk, then several
        packed = pair.plan(req, strategy="packed", staging_bytes=capacity)
        assert packed.packed and not packed.copies and (len(packed.chunks) > 1) == (capacity < busiest)
        for side in ("decode", "prefill"):
            a, b = transfer_cells(direct, pair, req, side=side), transfer_cells(packed, pair, req, side=side)
            assert [r.label for r in a.rows] == [r.label for r in b.rows]
            for x, y in zip(a.rows, b.rows):
                np.testing.assert_array_equal(x.codes, y.codes)


def test_prefill_view_colours_by_reading_d_rank() -> None:
    # P TP1 -> D TP2 (4 heads): P rank 0's heads 0-1 are read by D rank 0 and heads 2-3 by D rank 1;
    # P lists 3 blocks of 8 tokens, M = 20: tokens 20..23 are not read
    P = EngineGeometry.build(gqa(), tp=1, kernel_block_tokens=8, num_blocks=8, name="prefill")
    D = EngineGeometry.build(gqa(), tp=2, kernel_block_tokens=4, num_blocks=16, layout="NHD", name="decode")
    pair = Pair(P, D)
    req = fresh_request(pair, 20)
    cm = transfer_cells(pair.plan(req), pair, req, side="prefill")
    assert [r.label for r in cm.rows] == ["p0 attn L0 K,V h0-1", "p0 attn L0 K,V h2-3"]
    t = np.arange(24)
    for d_rank, row in enumerate(cm.rows):
        np.testing.assert_array_equal(row.codes, np.where(t < 20, d_rank * S, UNTOUCHED))
    fig = draw(pair.plan(req), pair, req, side="prefill")
    assert [x.get_text() for x in fig.axes[0].get_legend().get_texts()] == ["D rank 0", "D rank 1", "not read"]
    # MLA, replicated: both D ranks read P rank 0's latent (dotted "several")
    mla = ModelSpec("mla", [AttentionSpec("mla", "mla", 1, 1, 16)])
    pair = Pair(EngineGeometry.build(mla, tp=1, kernel_block_tokens=4, num_blocks=8, name="prefill"),
                EngineGeometry.build(mla, tp=2, kernel_block_tokens=4, num_blocks=8, name="decode"))
    req = fresh_request(pair, 8)
    cm = transfer_cells(pair.plan(req), pair, req, side="prefill", rank=0)
    np.testing.assert_array_equal(cm.rows[0].codes, np.full(8, 0 * S + SEVERAL))
    labels = [x.get_text() for x in draw(pair.plan(req), pair, req, side="prefill").axes[0].get_legend().get_texts()]
    assert "read by several D ranks" in labels


def test_state_rows_show_each_channel_source() -> None:
    # one state group, sections of 8 and 4 channels over P TP2 -> D TP1: D's channels 0..3 (0..1) from
    # P rank 0, 4..7 (2..3) from P rank 1, all from P's slot position 0
    model = ModelSpec("hyb", [AttentionSpec("mla", "mla", 2, 1, 16),
                              StateSpec("kda", 2, [StateSection("conv", 8, 2, rows=3), StateSection("rec", 4, 16)])])
    P = EngineGeometry.build(model, tp=2, kernel_block_tokens=4, blocks_per_logical=2, num_blocks=20,
                             regions="shared", name="prefill")
    D = EngineGeometry.build(model, tp=1, kernel_block_tokens=4, blocks_per_logical=3, num_blocks=20,
                             regions="shared", name="decode")
    pair = Pair(P, D)
    req = fresh_request(pair, 30, decode_tokens=31)
    cm = transfer_cells(pair.plan(req), pair, req)
    state = [r for r in cm.rows if r.kind == "state"]
    assert [r.label for r in state] == ["d0 kda L0-1 conv slot 3 (30 tok, 8 ch)", "d0 kda L0-1 rec slot 3 (30 tok, 4 ch)"]
    np.testing.assert_array_equal(state[0].codes, [0] * 4 + [S] * 4)
    np.testing.assert_array_equal(state[1].codes, [0] * 2 + [S] * 2)
    fig = draw(pair.plan(req), pair, req)
    assert len(fig.axes[0].get_yticklabels()) == len(cm.rows) == 3  # the MLA row (layers merged) + 2 state rows


def test_100k_tokens_aggregate_in_seconds() -> None:
    # D: 1563 blocks of 64 tokens = 100,032 listed tokens, M = 100,000; 256 cells of ceil(100032/256) = 391
    # tokens; the last cell holds tokens [99,705, 100,032): 295 computed + 32 zeroed -> zeroed 32/327
    m = gqa(heads=2, head_bytes=2)
    P = EngineGeometry.build(m, tp=1, kernel_block_tokens=16, num_blocks=6300, name="prefill")
    D = EngineGeometry.build(m, tp=1, kernel_block_tokens=16, blocks_per_logical=4, num_blocks=1600, name="decode")
    pair = Pair(P, D)
    req = fresh_request(pair, 100_000)
    plan = pair.plan(req)
    start = time.monotonic()
    cm = transfer_cells(plan, pair, req, max_cells=256)
    fig = draw(plan, pair, req, max_cells=256)
    assert time.monotonic() - start < 10
    assert (cm.tokens_per_cell, cm.cells, len(cm.rows)) == (391, 256, 1)
    row = cm.rows[0]
    assert (row.codes >= 0).all()  # every cell's majority is a P source
    assert row.zero_fraction[-1] == pytest.approx(32 / 327) and (row.zero_fraction[:-1] == 0).all()
    # cell 0 = tokens [0, 391): P blocks of 16 tokens 0..24, 16 tokens each but 7 in block 24: majority block 0
    assert row.codes[0] == 0
    assert "391 tokens per cell" in fig.axes[0].get_title()
    assert sum(patches(fig)) <= 256


def test_save_svg_and_png(tmp_path: Path) -> None:
    pair, req = tp2_to_tp1(20, 3)
    fig = draw(pair.plan(req), pair, req)
    svg, png = save(fig, tmp_path / "t.svg"), save(fig, tmp_path / "t.png")
    assert svg.read_text()[:200].lstrip().startswith("<?xml") and "<svg" in svg.read_text()
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with pytest.raises(DrawError):
        save(fig, tmp_path / "t.pdf")


def test_draw_into_given_axes_and_bad_arguments() -> None:
    from matplotlib.figure import Figure

    pair, req = tp2_to_tp1(20, 3)
    plan = pair.plan(req)
    fig = Figure()
    ax = fig.add_subplot()
    assert draw(plan, pair, req, ax=ax) is fig
    with pytest.raises(DrawError, match="side"):
        transfer_cells(plan, pair, req, side="both")
    with pytest.raises(DrawError, match="rank"):
        transfer_cells(plan, pair, req, rank=1)
    with pytest.raises(DrawError, match="max_cells"):
        transfer_cells(plan, pair, req, max_cells=0)


def test_top_level_draw_is_the_drawing_function() -> None:
    import kvgeom
    from kvgeom.building import get_preset

    pair, request = get_preset("gqa-tp2-tp4").build(tokens=32)
    fig = kvgeom.draw(pair.plan(request), pair, request)
    assert fig.axes


def test_pipeline_stages_show_which_p_stage_feeds_which_d_layers() -> None:
    """P PP2 x TP2 -> D TP1, 4 layers of 4 heads: D's layers 0-1 come from P ranks 0, 1 (stage 0, heads
    split by tp rank) and layers 2-3 from P ranks 2, 3 (stage 1); the legend names each P rank's stage."""
    from kvgeom import Topology

    m = gqa(layers=4)
    P = EngineGeometry.build(m, tp=2, kernel_block_tokens=4, num_blocks=8, name="prefill", topology=Topology(pp=2))
    D = EngineGeometry.build(m, tp=1, kernel_block_tokens=4, num_blocks=8, name="decode")
    pair = Pair(P, D)
    req = fresh_request(pair, 8)
    plan = pair.plan(req)
    cm = transfer_cells(plan, pair, req, rank=0)
    by_label = {r.label: set(r.codes.tolist()) for r in cm.rows}
    # heads 0-1 live on P tp rank 0, heads 2-3 on tp rank 1; flat rank = stage * 2 + tp rank
    assert by_label == {"d0 attn L0-1 K,V h0-1": {0 * S, 0 * S + 1}, "d0 attn L0-1 K,V h2-3": {1 * S, 1 * S + 1},
                        "d0 attn L2-3 K,V h0-1": {2 * S, 2 * S + 1}, "d0 attn L2-3 K,V h2-3": {3 * S, 3 * S + 1}}
    prefill = transfer_cells(plan, pair, req, side="prefill", rank=3)
    assert [r.label for r in prefill.rows] == ["p3[s1] attn L2-3 K,V h2-3"]  # stage 1 holds layers 2-3 only
    fig = draw(plan, pair, req)
    labels = [t.get_text() for t in fig.axes[0].get_legend().get_texts()]
    assert "P rank 3 (stage 1, tp 1)" in labels


def test_dcp_ranks_draw_only_their_tokens() -> None:
    """D TP2 DCP2, interleave 1, MLA: D rank 1 holds the odd tokens; its even token cells are not listed."""
    from kvgeom import Topology

    m = ModelSpec("mla", [AttentionSpec("mla", "mla", 1, 1, 8)])
    P = EngineGeometry.build(m, tp=1, kernel_block_tokens=4, num_blocks=4, name="prefill")
    D = EngineGeometry.build(m, tp=2, kernel_block_tokens=2, num_blocks=4, name="decode", topology=Topology(dcp=2))
    pair = Pair(P, D)
    req = fresh_request(pair, 6)  # D blocks of 2 * 2 = 4 tokens: [0, 8) listed, 6 and 7 zeroed
    plan = pair.plan(req)
    (row,) = transfer_cells(plan, pair, req, rank=1).rows
    assert row.label == "d1 mla L0 latent tokens t % 2 == 1"
    # tokens 0..7: odd ones on rank 1; tokens 1, 3 from P block position 0, 5 from position 1, 7 zeroed
    assert row.codes.tolist() == [NOT_LISTED, 0, NOT_LISTED, 0, NOT_LISTED, 1, NOT_LISTED, ZEROED]
