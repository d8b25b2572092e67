"""kvgeom.lowering.tiles: the tile size argument, the expansion of copies into table entries, and its inverse."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvgeom import (
    AttentionSpec,
    Copies,
    EngineGeometry,
    ModelSpec,
    Pair,
    PlanError,
    StateSection,
    StateSpec,
    TransferPlan,
    tile_bytes,
)
from kvgeom.lowering import TileTable, check_in_regions, tile_index_pairs, tile_quantities, tile_table


def merge_runs(p_index: np.ndarray, d_index: np.ndarray, tile: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The test's inverse of ``tile_index_pairs``. Re-merge index pairs into runs ``(p_start_index, d_start_index, nbytes)`` where both sides
    advance by one entry at a time: the inverse of the expansion, and what NIXL's merge does
    (NIXL also requires the entries to be adjacent in memory, which a run crossing from one region's
    tiles into the next region's does not satisfy; this function does not look at addresses)."""
    p = np.asarray(p_index, dtype=np.int64)
    d = np.asarray(d_index, dtype=np.int64)
    if p.size == 0:
        z = np.zeros(0, np.int64)
        return z, z, z
    brk = np.flatnonzero((np.diff(p) != 1) | (np.diff(d) != 1)) + 1
    starts = np.concatenate([[0], brk])
    lengths = np.diff(np.concatenate([starts, [p.size]]))
    return p[starts], d[starts], lengths * tile


def _llama(heads: int = 2, head_bytes: int = 256, layers: int = 1) -> ModelSpec:
    return ModelSpec("m", [AttentionSpec("attn", "full", layers, heads, head_bytes)])


def _copies(rows: Sequence[tuple[int, ...]]) -> Copies:
    a = np.array(rows, dtype=np.int64).reshape(-1, 7)
    return Copies(*(a[:, i] for i in range(7)))


# ---- tile_bytes ------------------------------------------------------------------------------


def test_tile_worked_number_hnd() -> None:
    # 2 local heads of 256 B, K=16, packed: page = 2 planes * 2 heads * 16 tokens * 256 B = 16384,
    # kv_stride = 2 * 16 * 256 = 8192, head_stride = 16 * 256 = 4096, token_stride = 256 -> 256.
    e = EngineGeometry.build(_llama(), tp=1, kernel_block_tokens=16, num_blocks=4)
    assert e.regions[0].page_bytes == 16384
    assert tile_bytes(Pair(e, e)) == 256


def test_tile_follows_the_smallest_quantity() -> None:
    # head_bytes 96 on a TP1 HND page: strides 2*16*96, 16*96, 96 -> gcd 96; NHD on D with 8-token
    # pages: head_stride 96, token_stride 2*96 -> still 96.
    m = _llama(head_bytes=96)
    p = EngineGeometry.build(m, tp=1, kernel_block_tokens=16, num_blocks=4)
    d = EngineGeometry.build(m, tp=2, kernel_block_tokens=8, num_blocks=4, layout="NHD")
    assert tile_bytes(Pair(p, d)) == 96


def test_tile_for_channel_sliced_state() -> None:
    # conv x: 8192 channels x 3 rows x 2 B, channel_major. TP1 -> TP4 slices are 8192 and 2048
    # channels: boundaries every gcd(8192, 2048) = 2048 channels = 2048 * 6 B = 12288 B. With
    # 4096-byte pages (the state fills ppl pages) the tile is gcd(12288, 4096 * k, ...) = 4096.
    m = ModelSpec("s", [StateSpec("mamba", 1, [StateSection("x", 8192, 2, rows=3)])])
    p = EngineGeometry.build(m, tp=1, kernel_block_tokens=16, num_blocks=2, blocks_per_logical=12)
    d = EngineGeometry.build(m, tp=4, kernel_block_tokens=16, num_blocks=2, blocks_per_logical=3)
    # P state = 8192*6 = 49152 B over 12 pages -> page 4096; D state = 12288 B over 3 pages -> 4096
    assert p.regions[0].page_bytes == 4096 and d.regions[0].page_bytes == 4096
    names = dict(tile_quantities(Pair(p, d)))
    assert names["prefill.groups[0].sections[x].channel_stride*2048"] == 2048 * 6
    assert tile_bytes(Pair(p, d)) == 4096


def test_tile_for_state_layouts_that_differ_falls_to_units() -> None:
    m = ModelSpec("s", [StateSpec("mamba", 1, [StateSection("x", 8, 2, rows=3), StateSection("B", 4, 2, rows=3)])])
    p = EngineGeometry.build(m, tp=1, kernel_block_tokens=4, num_blocks=2)
    d = EngineGeometry.build(m, tp=1, kernel_block_tokens=4, num_blocks=2, state_layout="state_major")
    assert tile_bytes(Pair(p, d)) == 2


def _all_plans() -> list[tuple[str, Pair, TransferPlan]]:
    import kvgeom.building.presets as presets
    from kvgeom import STRATEGIES, plan_pair

    out: list[tuple[str, Pair, TransferPlan]] = []
    for name, preset in presets.PRESETS.items():
        if not preset.pairable:
            continue
        for tokens in (None, 37):
            pair, req = preset.build(tokens)
            for strategy in STRATEGIES:
                if strategy == "auto":
                    continue
                out.append((f"{name}/{tokens}/{strategy}", pair, plan_pair(pair, req, strategy=strategy)))  # type: ignore[arg-type]
    return out


def test_tile_divides_every_copy_of_every_preset_plan() -> None:
    """The argument, checked against the planner on every preset (and a short odd request)."""
    checked = 0
    for name, pair, plan in _all_plans():
        t = tile_bytes(pair)
        c = plan.copies
        for col in (c.p_offset, c.d_offset, c.nbytes):
            assert not np.any(col % t), (name, t)
        p_idx, d_idx = tile_index_pairs(c, t, p_table=tile_table(pair.prefill, t), d_table=tile_table(pair.decode, t))
        assert p_idx.size == c.total_bytes // t
        checked += 1
    assert checked >= 10


# ---- tile_index_pairs ---------------------------------------------------------------------


def test_index_pairs_worked_number() -> None:
    # p_offset 8192, d_offset 0, 4096 B at 1024-byte tiles: P tiles 8..11, D tiles 0..3; then a
    # second copy of 2048 B from P 0 to D 8192: P 0..1, D 8..9.
    c = _copies([(0, 0, 8192, 0, 0, 0, 4096), (0, 0, 0, 0, 0, 8192, 2048)])
    p, d = tile_index_pairs(c, 1024)
    assert p.tolist() == [8, 9, 10, 11, 0, 1]
    assert d.tolist() == [0, 1, 2, 3, 8, 9]
    assert p.dtype == np.int64 and d.dtype == np.int64


def test_index_pairs_with_tables_offset_by_region() -> None:
    # P regions of 3 and 2 tiles (256 B each): region 1 starts at entry 3.  D one region of 4 tiles.
    pt = TileTable(256, (768, 512))
    dt = TileTable(256, (1024,))
    assert pt.first.tolist() == [0, 3] and pt.num_tiles == 5
    reg, off = pt.entries()
    assert reg.tolist() == [0, 0, 0, 1, 1] and off.tolist() == [0, 256, 512, 0, 256]
    c = _copies([(0, 1, 256, 0, 0, 0, 256), (0, 0, 0, 0, 0, 512, 512)])
    p, d = tile_index_pairs(c, 256, p_table=pt, d_table=dt)
    assert p.tolist() == [4, 0, 1]
    assert d.tolist() == [0, 2, 3]


def test_index_pairs_reject_misaligned_and_out_of_region() -> None:
    with pytest.raises(PlanError, match=r"Copies.d_offset\[1\]: 100 is not a multiple of the 256 B tile"):
        tile_index_pairs(_copies([(0, 0, 0, 0, 0, 0, 256), (0, 0, 256, 0, 0, 100, 256)]), 256)
    with pytest.raises(PlanError, match=r"Copies.nbytes\[0\]"):
        tile_index_pairs(_copies([(0, 0, 0, 0, 0, 0, 300)]), 256)
    pt = TileTable(256, (768, 512))
    # P region 1 has 512 B: bytes [256, 768) leave it (would alias nothing, but must not be indexed)
    with pytest.raises(PlanError, match=r"Copies.p_offset\[0\]: bytes \[256, 768\) leave region 1 of 512 B"):
        tile_index_pairs(_copies([(0, 1, 256, 0, 0, 0, 512)]), 256, p_table=pt, d_table=TileTable(256, (1024,)))
    with pytest.raises(PlanError, match=r"Copies.d_region\[0\]: region 3 does not exist"):
        tile_index_pairs(_copies([(0, 0, 0, 0, 3, 0, 256)]), 256, p_table=pt, d_table=TileTable(256, (1024,)))
    with pytest.raises(PlanError, match="table tile 512 != requested 256"):
        tile_index_pairs(_copies([(0, 0, 0, 0, 0, 0, 256)]), 256, p_table=TileTable(512, (1024,)))
    with pytest.raises(PlanError, match="not a positive multiple"):
        TileTable(256, (1000,))
    with pytest.raises(PlanError, match="must be positive"):
        tile_index_pairs(_copies([]), 0)


def test_check_in_regions() -> None:
    c = _copies([(0, 0, 0, 0, 1, 100, 28)])
    check_in_regions(c, [64], [64, 128])
    with pytest.raises(PlanError, match=r"Copies.d_offset\[0\]: bytes \[100, 128\) leave region 1 of 100 B"):
        check_in_regions(c, [64], [64, 100])
    with pytest.raises(PlanError, match=r"Copies.p_region\[0\]"):
        check_in_regions(c, [], [64, 128])


def test_empty_copies() -> None:
    p, d = tile_index_pairs(Copies.empty(), 64)
    assert p.size == 0 and d.size == 0
    assert all(x.size == 0 for x in merge_runs(p, d, 64))


# ---- properties: expand, re-merge, bounds ---------------------------------------------------


@st.composite
def _case(draw: st.DrawFn) -> tuple[int, TileTable, TileTable, Copies]:
    tile = draw(st.sampled_from([1, 8, 64, 256]))
    p_tiles = draw(st.lists(st.integers(1, 12), min_size=1, max_size=4))
    d_tiles = draw(st.lists(st.integers(1, 12), min_size=1, max_size=4))
    rows = []
    for _ in range(draw(st.integers(0, 8))):
        pr = draw(st.integers(0, len(p_tiles) - 1))
        dr = draw(st.integers(0, len(d_tiles) - 1))
        n = draw(st.integers(1, min(p_tiles[pr], d_tiles[dr])))
        po = draw(st.integers(0, p_tiles[pr] - n))
        do = draw(st.integers(0, d_tiles[dr] - n))
        rows.append((0, pr, po * tile, 0, dr, do * tile, n * tile))
    return (tile, TileTable(tile, [t * tile for t in p_tiles]), TileTable(tile, [t * tile for t in d_tiles]),
            _copies(rows))


def _byte_map(c: Copies) -> set[tuple[int, int, int, int]]:
    out: set[tuple[int, int, int, int]] = set()
    for pr, po, dr, do, n in zip(c.p_region, c.p_offset, c.d_region, c.d_offset, c.nbytes, strict=True):
        out.update((int(pr), int(po) + k, int(dr), int(do) + k) for k in range(int(n)))
    return out


@settings(max_examples=150, deadline=None)
@given(_case())
def test_expansion_preserves_the_byte_mapping_and_stays_in_regions(case: tuple[int, TileTable, TileTable, Copies]) -> None:
    tile, pt, dt, c = case
    p, d = tile_index_pairs(c, tile, p_table=pt, d_table=dt)
    assert p.size == d.size == c.total_bytes // tile
    preg, poff = pt.entries()
    dreg, doff = dt.entries()
    # every tile lies inside the region of the copy it came from (never crosses a region bound)
    rows = np.repeat(np.arange(len(c)), c.nbytes // tile)
    assert np.array_equal(preg[p], c.p_region[rows]) and np.array_equal(dreg[d], c.d_region[rows])
    assert np.all(poff[p] + tile <= np.asarray(pt.region_bytes)[preg[p]])
    assert np.all(doff[d] + tile <= np.asarray(dt.region_bytes)[dreg[d]])
    # re-merging the index pairs (NIXL's merge, plus the address check it does) gives back the bytes
    ps, ds, nb = merge_runs(p, d, tile)
    merged = []
    for a, b, n in zip(ps, ds, nb, strict=True):
        # split a run where it would cross from one region's tiles into the next (NIXL would too)
        k = 0
        while k < n // tile:
            j = k
            while j + 1 < n // tile and preg[a + j + 1] == preg[a + k] and dreg[b + j + 1] == dreg[b + k]:
                j += 1
            merged.append((0, int(preg[a + k]), int(poff[a + k]), 0, int(dreg[b + k]), int(doff[b + k]),
                           (j - k + 1) * tile))
            k = j + 1
    assert _byte_map(_copies(merged)) == _byte_map(c)
    assert len(merged) <= len(c)


def test_merge_runs_inverts_expansion_of_minimal_copies() -> None:
    c = _copies([(0, 0, 0, 0, 0, 512, 512), (0, 0, 1024, 0, 0, 0, 256), (0, 0, 512, 0, 0, 1024, 256)])
    p, d = tile_index_pairs(c, 256)
    ps, ds, nb = merge_runs(p, d, 256)
    assert (ps * 256).tolist() == c.p_offset.tolist()
    assert (ds * 256).tolist() == c.d_offset.tolist()
    assert nb.tolist() == c.nbytes.tolist()


def test_tile_rows_names_the_copy_of_every_tile_pair() -> None:
    from kvgeom.lowering import tile_index_pairs, tile_rows

    # copy 0: 2 tiles of 1024 B, copy 1: 3 tiles
    c = Copies([0, 1], [0, 0], [0, 8192], [0, 0], [0, 0], [4096, 0], [2048, 3072])
    p_idx, d_idx = tile_index_pairs(c, 1024)
    assert tile_rows(c, 1024).tolist() == [0, 0, 1, 1, 1]
    assert p_idx.tolist() == [0, 1, 8, 9, 10] and d_idx.tolist() == [4, 5, 0, 1, 2]
