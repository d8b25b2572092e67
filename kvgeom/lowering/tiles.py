"""Fixed-granularity descriptor tables: the arithmetic of lowering a plan to prepared NIXL lists.

An executor may prepare, once per rank, one descriptor table that cuts every region into tiles of
``tile_bytes`` and then post each request as two index lists into the two sides' tables. Region r's
tiles are a contiguous block of the rank's table, starting at entry ``first[r]``::

    region 0 (3 tiles)   region 1 (2 tiles)          tile = 256 B
    | 0 | 1 | 2 |        | 3 | 4 |                    entry first[r] + i = region r bytes [i*256, (i+1)*256)

    copy (p_region 1, p_offset 256, d_region 0, d_offset 0, nbytes 512)
      -> P entries [first_p[1] + 1, first_p[1] + 2] = [4, 5] (on P's table)
      -> D entries [first_d[0] + 0, first_d[0] + 1] = [0, 1] (on D's table)

Entry i of the P index list pairs with entry i of the D index list; each copy expands into
``nbytes / tile`` consecutive pairs in row order, so NIXL's own merge (consecutive indices over
memory-contiguous entries) folds each copy back into one descriptor.

Worked number: a copy of 4096 B at P offset 8192 with 1024-byte tiles covers P entries
``8192/1024 .. 8192/1024 + 4096/1024 - 1`` = 8 .. 11 of its region.

Everything here is pure numpy; the executor only adds base addresses and hands arrays to NIXL.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import attrs
import numpy as np

from ..errors import InternalError, PlanError
from ..values.blocks import CopyBlock
from ..values.engine import EngineGeometry
from ..values.layout import AttentionGroupGeometry, StateGroupGeometry, StateLayout
from ..values.model import AttentionSpec, StateSpec
from ..values.pair import CheckedEngines
from ..values.plan import Copies

__all__ = ["tile_rows", "tile_bytes", "tile_quantities", "TileTable", "tile_table", "tile_index_pairs",
           "tile_index_blocks", "check_in_regions", "rank_region_bytes"]


def _channel_grain(n: int, tp_a: int, tp_b: int, replicated: bool) -> int:
    """Channels between two slice boundaries any P/D slice intersection can have (local index)."""
    if replicated:
        return n
    size_a = n // tp_a if tp_a <= n else 1
    size_b = n // tp_b if tp_b <= n else 1
    return math.gcd(size_a, size_b)


def tile_quantities(pair: CheckedEngines) -> tuple[tuple[str, int], ...]:
    """Every byte quantity from which a copy boundary is built, named (see :func:`tile_bytes`)."""
    out: list[tuple[str, int]] = []
    sides = (("prefill", pair.prefill, pair.decode), ("decode", pair.decode, pair.prefill))
    for side, e, other in sides:
        for ri, r in enumerate(e.regions):
            out.append((f"{side}.regions[{ri}].page_bytes", r.page_bytes))
        for gi, (spec, geo) in enumerate(zip(e.model.groups, e.groups, strict=True)):
            g = f"{side}.groups[{gi}]"
            if isinstance(geo, AttentionGroupGeometry):
                if not isinstance(spec, AttentionSpec):
                    raise InternalError("the engine validated group kinds")
                lay = geo.layout
                out += [(f"{g}.head_bytes", spec.head_bytes), (f"{g}.layout.kv_stride", lay.kv_stride),
                        (f"{g}.layout.head_stride", lay.head_stride),
                        (f"{g}.layout.token_stride", lay.token_stride)]
            else:
                if not (isinstance(spec, StateSpec) and isinstance(geo, StateGroupGeometry)):
                    raise InternalError("as above")
                other_geo = other.groups[gi]
                same = isinstance(other_geo, StateGroupGeometry) and other_geo.layout == geo.layout
                for sec, place in zip(spec.sections, e.state_sections(gi), strict=True):
                    c = _channel_grain(sec.channels, e.tp, other.tp, sec.replicated)
                    sp = f"{g}.sections[{sec.name}]"
                    out.append((f"{sp}.offset", place.offset))
                    if same and geo.layout is StateLayout.CHANNEL_MAJOR:
                        out.append((f"{sp}.channel_stride*{c}", c * place.channel_stride))
                    elif same:
                        out += [(f"{sp}.row_stride", place.row_stride),
                                (f"{sp}.channel_stride*{c}", c * place.channel_stride)]
                    else:
                        out += [(f"{sp}.unit_bytes", place.unit_bytes), (f"{sp}.row_stride", place.row_stride),
                                (f"{sp}.channel_stride", place.channel_stride)]
            views: tuple[Any, ...] = geo.views
            out += [(f"{g}.views[{li}].offset", v.offset) for li, v in enumerate(views)]
    return tuple((name, int(q)) for name, q in out)


def tile_bytes(pair: CheckedEngines) -> int:
    """The largest tile that divides every copy boundary any plan for ``pair`` can produce.

    The argument. A copy moves a run of whole *units* between two addresses that are each built
    as a sum of integer multiples of the quantities :func:`tile_quantities` lists; a sum of
    multiples of their gcd ``g`` is a multiple of ``g``, so ``p_offset``, ``d_offset`` and
    ``nbytes`` (an end minus a start) are multiples of ``g`` on both sides:

    * attention: a head vector of ``head_bytes`` (a latent for MLA) starts at
      ``page * page_bytes + view.offset + plane * kv_stride + head * head_stride + slot * token_stride``
      and ends ``head_bytes`` later, whatever the two layouts are;
    * state, same layout on both sides: D rank's slice of a section intersects a P rank's slice
      on channel boundaries that are multiples of ``c = gcd(P slice, D slice)`` channels (slices
      start at multiples of their size, so local channel indices of a boundary are multiples of
      ``c`` too). ``channel_major`` keeps all rows of a channel together, so a run starts at
      ``slot * page_bytes * ppl + view.offset + section.offset + k * c * channel_stride``;
      ``state_major`` keeps each row apart, adding ``row * row_stride``. Rows are never split;
    * state, different layouts: runs can shrink to one ``(channel, row)`` unit, so
      ``unit_bytes``, ``row_stride`` and ``channel_stride`` all count.

    Coalescing only removes boundaries (two adjacent copies become one), and a staged copy moves
    whole sub-pages built from the same strides times ``head_bytes``, so neither adds a boundary
    off the grid. Every region size ``num_pages * page_bytes`` is a multiple of ``g`` too, so no
    tile straddles two regions. Zero quantities (``kv_stride`` 0 for split planes, views at offset
    0) do not constrain the gcd (``gcd(0, x) = x``). :func:`tile_index_pairs` re-checks every copy
    and raises :class:`PlanError` if a plan ever breaks the argument.

    Worked number: HND, 2 local heads of 256 B, K = 16, K/V packed on both sides: pages of
    16384 B, strides 8192 / 4096 / 256, head_bytes 256 -> tile 256. A conv section of 8192
    channels x 3 rows x 2 B, channel_major, TP1 -> TP4: c = gcd(8192, 2048) = 2048 channels,
    2048 * 6 = 12288 B; with 16384-byte pages the gcd is 4096, not the 2 B of one unit.
    """
    g = 0
    for _, q in tile_quantities(pair):
        g = math.gcd(g, q)
    return g


def _int_tuple(value: Iterable[int]) -> tuple[int, ...]:
    return tuple(int(v) for v in value)


@attrs.frozen
class TileTable:
    """One rank's table: region ``r`` is entries ``[first[r], first[r] + tiles[r])``.

    Entry ``first[r] + i`` describes bytes ``[i*tile_bytes, (i+1)*tile_bytes)`` of region ``r``.
    """

    tile_bytes: int
    region_bytes: tuple[int, ...] = attrs.field(converter=_int_tuple)

    def __attrs_post_init__(self) -> None:
        if self.tile_bytes <= 0:
            raise PlanError("TileTable.tile_bytes", "must be positive", actual=self.tile_bytes, expected=">= 1")
        for r, n in enumerate(self.region_bytes):  # 0 B: a region of another pipeline stage (no tiles)
            if n < 0 or n % self.tile_bytes:
                raise PlanError(f"TileTable.region_bytes[{r}]", f"{n} B is not a positive multiple of the "
                                f"{self.tile_bytes} B tile (nor 0, a region of another pipeline stage)", actual=n,
                                expected=f"a multiple of {self.tile_bytes}",
                                fix="use kvgeom.lowering.tiles.tile_bytes(pair), which divides every region size")

    @property
    def tiles(self) -> np.ndarray:
        """Tiles per region."""
        return np.asarray(self.region_bytes, dtype=np.int64) // self.tile_bytes

    @property
    def first(self) -> np.ndarray:
        """Index of each region's first entry in the table."""
        t = self.tiles
        return np.cumsum(t) - t

    @property
    def num_tiles(self) -> int:
        return int(self.tiles.sum())

    def entries(self) -> tuple[np.ndarray, np.ndarray]:
        """``(region, byte offset in region)`` of every entry, in table order (int64 arrays)."""
        t = self.tiles
        region = np.repeat(np.arange(len(t), dtype=np.int64), t)
        offset = (np.arange(int(t.sum()), dtype=np.int64) - np.repeat(self.first, t)) * self.tile_bytes
        return region, offset


def rank_region_bytes(engine: EngineGeometry, rank: int | None = None) -> tuple[int, ...]:
    """Bytes of every region on ``rank``: 0 for the regions of other pipeline stages
    (docs/design.md §11.4); ``rank`` None: every region whole (a one-stage engine's ranks)."""
    if rank is None:
        return tuple(r.nbytes for r in engine.regions)
    held = set(engine.rank_regions(rank))
    return tuple(r.nbytes if i in held else 0 for i, r in enumerate(engine.regions))


def tile_table(engine: EngineGeometry, tile: int, rank: int | None = None) -> TileTable:
    """The table of one rank of ``engine``: every rank of a stage has the same shape, and the
    regions of other stages have no tiles (``rank`` None: every region, a one-stage engine)."""
    return TileTable(tile, rank_region_bytes(engine, rank))


def _check_multiple(name: str, col: np.ndarray, tile: int) -> None:
    bad = np.flatnonzero(col % tile)
    if bad.size:
        i = int(bad[0])
        raise PlanError(f"Copies.{name}[{i}]", f"{int(col[i])} is not a multiple of the {tile} B tile",
                        actual=int(col[i]), expected=f"a multiple of {tile}",
                        fix="use mode 'coalesced', or a tile that divides every copy boundary (kvgeom.lowering.tiles.tile_bytes)")


def _check_side(side: str, region: np.ndarray, offset: np.ndarray, nbytes: np.ndarray,
                region_bytes: tuple[int, ...] | list[int]) -> None:
    nreg = len(region_bytes)
    bad = np.flatnonzero(region >= nreg)
    if bad.size:
        i = int(bad[0])
        raise PlanError(f"Copies.{side}_region[{i}]", f"region {int(region[i])} does not exist on a rank with "
                        f"{nreg} regions", actual=int(region[i]), expected=f"< {nreg}",
                        fix="the plan does not fit this engine; re-plan against its advertised geometry")
    sizes = np.asarray(region_bytes, dtype=np.int64)
    over = np.flatnonzero(offset + nbytes > sizes[region])
    if over.size:
        i = int(over[0])
        raise PlanError(f"Copies.{side}_offset[{i}]", f"bytes [{int(offset[i])}, {int(offset[i] + nbytes[i])}) "
                        f"leave region {int(region[i])} of {int(sizes[region[i]])} B",
                        actual=int(offset[i] + nbytes[i]), expected=f"<= {int(sizes[region[i]])}",
                        fix="the plan does not fit this engine; re-plan against its advertised geometry")


def check_in_regions(copies: Copies, p_region_bytes: tuple[int, ...] | list[int],
                     d_region_bytes: tuple[int, ...] | list[int]) -> None:
    """Raise :class:`PlanError` unless every copy stays inside its P and its D region.

    An executor runs this on every request before posting: a plan made from a remote's
    self-description is untrusted, and a copy past a region's end would write someone else's memory.
    """
    _check_side("p", copies.p_region, copies.p_offset, copies.nbytes, p_region_bytes)
    _check_side("d", copies.d_region, copies.d_offset, copies.nbytes, d_region_bytes)


def _table_starts(side: str, region: np.ndarray, offset: np.ndarray, nbytes: np.ndarray, tile: int,
                  table: TileTable | None) -> np.ndarray:
    """First entry of each copy on one side: ``first[region] + offset / tile``."""
    if table is None:
        return offset // tile
    if table.tile_bytes != tile:
        raise PlanError(f"{side}_table.tile_bytes", f"table tile {table.tile_bytes} != requested {tile}",
                        actual=table.tile_bytes, expected=tile, fix="build both tables with the same tile")
    _check_side(side, region, offset, nbytes, table.region_bytes)
    return table.first[region] + offset // tile


def tile_index_pairs(copies: Copies, tile: int, *, p_table: TileTable | None = None,
                     d_table: TileTable | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Expand each copy into its tiles: ``(p_index, d_index)``, int64, row-major over the copies.

    Without tables the indices count tiles inside each copy's own region (entry ``i`` = region
    bytes ``[i*tile, (i+1)*tile)``); with tables they are entries of the rank's whole table
    (``first[region] + offset/tile``) and every copy is checked to stay inside its region, so an
    index can never alias the next region's tiles. Raises :class:`PlanError` when an offset or a
    size is not a multiple of ``tile``.

    >>> # copy p_offset 8192 -> d_offset 0, 4096 B, tile 1024: p [8, 9, 10, 11], d [0, 1, 2, 3]
    """
    if int(tile) <= 0:
        raise PlanError("tile_bytes", "must be positive", actual=tile, expected=">= 1")
    tile = int(tile)
    for name in ("p_offset", "d_offset", "nbytes"):
        _check_multiple(name, getattr(copies, name), tile)
    n = copies.nbytes // tile
    p0 = _table_starts("p", copies.p_region, copies.p_offset, copies.nbytes, tile, p_table)
    d0 = _table_starts("d", copies.d_region, copies.d_offset, copies.nbytes, tile, d_table)
    total = int(n.sum())
    row_start = np.cumsum(n) - n  # position of each copy's first tile in the output
    step = np.arange(total, dtype=np.int64)
    p_index = np.repeat(p0 - row_start, n) + step
    d_index = np.repeat(d0 - row_start, n) + step
    return p_index, d_index


def tile_rows(copies: Copies, tile: int) -> np.ndarray:
    """The copy row each pair of :func:`tile_index_pairs` comes from (same order, same length).

    >>> # two copies of 2 and 3 tiles: rows [0, 0, 1, 1, 1]
    """
    if int(tile) <= 0:
        raise PlanError("tile_bytes", "must be positive", actual=tile, expected=">= 1")
    _check_multiple("nbytes", copies.nbytes, int(tile))
    return np.repeat(np.arange(len(copies), dtype=np.int64), copies.nbytes // int(tile))


def _check_block(side: str, region: np.ndarray, shift: np.ndarray, base: np.ndarray, nbytes: np.ndarray,
                 shared: bool, sizes: np.ndarray) -> None:
    if len(region) and int(region.max()) >= len(sizes):
        s = int(np.argmax(region >= len(sizes)))
        raise PlanError(f"CopyBlock.{side}_region[{s}]", f"region {int(region[s])} does not exist on a rank with "
                        f"{len(sizes)} regions", actual=int(region[s]), expected=f"< {len(sizes)}",
                        fix="the plan does not fit this engine; re-plan against its advertised geometry")
    end = shift + (int((base + nbytes).max()) if shared else base[0] + nbytes)
    over = np.flatnonzero((end > sizes[region]) | (shift + int(base.min()) < 0))
    if over.size:
        s = int(over[0])
        raise PlanError(f"CopyBlock.{side}_shift[{s}]", f"rows reach byte {int(end[s])} of region {int(region[s])} "
                        f"of {int(sizes[region[s]])} B", actual=int(end[s]), expected=f"<= {int(sizes[region[s]])}",
                        fix="the plan does not fit this engine; re-plan against its advertised geometry")


def tile_index_blocks(blocks: Iterable[CopyBlock], tile: int, *, p_tables: Any,
                      d_tables: Any) -> dict[tuple[int, int], tuple[np.ndarray, np.ndarray]]:
    """:func:`tile_index_pairs` straight from outer-sum blocks, per (P rank, D rank): the index
    lists into the two ranks' tables, in the plan's row order, without writing byte columns.

    ``p_tables[p]`` / ``d_tables[d]`` are the :class:`TileTable` of P rank ``p`` / D rank ``d``
    (a mapping or a callable). Every row is checked against its regions' sizes and the tile grid
    first (:class:`PlanError`), like :func:`tile_index_pairs` with tables.

    Worked number: a block of 2 streams x 3 rows of one 1024-byte tile each, D offsets
    ``base [0, 4096, 8192] + shift [0, 1024]`` in region 0 (first entry 0) gives D indices
    ``[0, 4, 8]`` and ``[1, 5, 9]``.
    """
    tile = int(tile)
    if tile <= 0:
        raise PlanError("tile_bytes", "must be positive", actual=tile, expected=">= 1")

    def table(tables: Any, rank: int) -> TileTable:
        got = tables(rank) if callable(tables) else tables[rank]
        if got.tile_bytes != tile:
            raise PlanError("table.tile_bytes", f"table tile {got.tile_bytes} != requested {tile}",
                            actual=got.tile_bytes, expected=tile, fix="build both tables with the same tile")
        return got

    parts: dict[tuple[int, int], list[tuple[np.ndarray, np.ndarray]]] = {}
    for b in blocks:
        S, H = b.streams, b.per_stream
        if not S * H:
            continue
        shared = len(b.nbytes) == H
        for name, col in (("p_shift", b.p_shift), ("d_shift", b.d_shift), ("p_base", b.p_base),
                          ("d_base", b.d_base), ("nbytes", b.nbytes)):
            _check_multiple(name, col, tile)
        keys = b.p_rank * (int(b.d_rank.max()) + 1) + b.d_rank
        cut = np.flatnonzero(np.concatenate(([True], keys[1:] != keys[:-1], [True])))
        for a, z in zip(cut[:-1].tolist(), cut[1:].tolist()):
            p, d = int(b.p_rank[a]), int(b.d_rank[a])
            pt, dt = table(p_tables, p), table(d_tables, d)
            sl = slice(a, z)
            nb = b.nbytes if shared else b.nbytes[sl]
            _check_block("p", b.p_region[sl], b.p_shift[sl], b.p_base, nb, shared, np.asarray(pt.region_bytes, np.int64))
            _check_block("d", b.d_region[sl], b.d_shift[sl], b.d_base, nb, shared, np.asarray(dt.region_bytes, np.int64))
            p0 = pt.first[b.p_region[sl]] + b.p_shift[sl] // tile  # per stream
            d0 = dt.first[b.d_region[sl]] + b.d_shift[sl] // tile
            if shared:
                k = b.nbytes // tile  # tiles of each base row
                if np.all(k == 1):
                    p_idx = (p0[:, None] + (b.p_base // tile)[None, :]).ravel()
                    d_idx = (d0[:, None] + (b.d_base // tile)[None, :]).ravel()
                else:
                    total = int(k.sum())
                    step = np.arange(total, dtype=np.int64) - np.repeat(np.cumsum(k) - k, k)
                    p_row = np.repeat(b.p_base // tile, k) + step
                    d_row = np.repeat(b.d_base // tile, k) + step
                    p_idx = (p0[:, None] + p_row[None, :]).ravel()
                    d_idx = (d0[:, None] + d_row[None, :]).ravel()
            else:  # one base row, one size per stream
                k = b.nbytes[sl] // tile
                total = int(k.sum())
                step = np.arange(total, dtype=np.int64) - np.repeat(np.cumsum(k) - k, k)
                p_idx = np.repeat(p0 + b.p_base[0] // tile, k) + step
                d_idx = np.repeat(d0 + b.d_base[0] // tile, k) + step
            parts.setdefault((p, d), []).append((p_idx, d_idx))
    return {key: (np.concatenate([x[0] for x in v]), np.concatenate([x[1] for x in v])) if len(v) > 1 else v[0]
            for key, v in parts.items()}
