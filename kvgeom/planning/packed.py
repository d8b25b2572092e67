"""The packed strategy: gather on P, a few large wire rows, scatter on D (docs/design.md §12).

Every group (attention and state) moves through staging. Per chunk, P rank p packs what each D
rank needs into its slot, one wire row per (P rank, D rank) crosses, D rank d unpacks::

    request --pieces--> chunks (layers of a group; token ranges or sections when one layer does not fit)
      chunk c, pair (p, d):  pack steps   P cache pages -> P slot   (cut at P and D pages)
                             wire row     P slot [p_base, +n) -> D slot [d_base, +n)
                             unpack steps D slot -> D cache pages   (cut at D pages only)
    then the zeros of the direct strategy (kvgeom.planning.attention.attention_zeros)

Staging is dense and in D's order (§12.2): a (p, d) block is the chunk's pieces in order; an
attention piece is layer entries x D pages x D's in-page order of (plane, head, token) restricted
to the pair's heads and the piece's tokens; a state piece is layers x sections x paired slots x
[channel slice][rows][unit]. Steps are grouped by *class*, the entries that share one strided
pattern: unpacks by (first slot, tokens) of their D page, packs by (P slot, tokens, tokens of
the D page they land in).

Worked number (the default preset, M = 100, S = 16): D rank 1 needs tokens [16, 100) of heads
[2, 4) from P rank 0: 10 full D pages (one unpack class, one 8192-byte element per page) and one
of 4 tokens (a second class); per layer ``10 * 8192 + 4096 = 86,016 B``, so its block from P rank
0 is ``4 * 86,016 = 344,064 B`` and the plan has one wire row per (P rank, D rank): 4.
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs
import numpy as np

from ..arith.runs import Mode, dense_strides, fold_modes
from ..arith.shard import owned_slice, sources
from ..arith.tokens import segments
from ..errors import InternalError, StagingCapacityError
from ..values.fields import check_int
from ..values.layout import StateGroupGeometry
from ..values.model import AttentionSpec, StateSpec
from ..values.notes import Note, NoteKind
from ..values.pair import EnginePair
from ..values.plan import Zeros
from ..values.request import BlockList, Request
from ..values.staging import Chunk, ChunkPiece, StagingStep, WireCopies
from ..values.text import format_bytes
from .attention import attention_zeros, needed_tokens
from .sides import SideView
from .state import paired_slots, state_notes

__all__ = ["DEFAULT_STAGING_BYTES", "PackedParts", "PackedCount", "plan_packed", "count_packed",
           "min_staging_bytes"]

DEFAULT_STAGING_BYTES = 256 << 20
"""Default slot capacity per rank (bytes one chunk may stage on one rank): 256 MiB."""


@attrs.frozen
class _Slice:
    """The items (heads or channels) P rank ``p`` sends D rank ``d``: ``n`` of them, starting at
    local item ``p0`` on P and ``d0`` on D."""

    p: int
    d: int
    n: int
    p0: int
    d0: int


@attrs.frozen(eq=False)
class _Group:
    """What one group moves, per layer and per (P rank, D rank) pair."""

    index: int
    layers: int
    attention: bool
    lo: int = 0  # attention: tokens [lo, hi)
    hi: int = 0
    unit: int = 0  # attention: bytes of one token of one layer per item (planes * head_bytes)
    pairs: tuple[_Slice, ...] = ()  # attention
    sections: tuple[tuple[_Slice, ...], ...] = ()  # state: per section
    section_bytes: tuple[int, ...] = ()  # state: bytes of one channel of one section (rows * unit) x paired slots
    p_slots: tuple[int, ...] = ()
    d_slots: tuple[int, ...] = ()


def _slices(n_items: int, replicated: bool, p_tp: int, d_tp: int) -> tuple[_Slice, ...]:
    out = []
    for d in range(d_tp):
        d_slice = owned_slice(n_items, d_tp, d, replicated=replicated)
        for src in sources(n_items, p_tp=p_tp, p_replicated=replicated, d_tp=d_tp, d_rank=d,
                           d_replicated=replicated):
            p_slice = owned_slice(n_items, p_tp, src.p_rank, replicated=replicated)
            out.append(_Slice(src.p_rank, d, src.items.size, src.items.start - p_slice.start,
                              src.items.start - d_slice.start))
    return tuple(sorted(out, key=lambda s: (s.d, s.p)))


def _groups(pair: EnginePair, request: Request) -> list[_Group]:
    P, D = pair.prefill, pair.decode
    out: list[_Group] = []
    for gi, spec in enumerate(pair.model.groups):
        if isinstance(spec, AttentionSpec):
            lo, hi = needed_tokens(request, pair, gi)
            pairs = _slices(spec.num_kv_heads, spec.replicated, P.tp, D.tp) if hi > lo else ()
            out.append(_Group(gi, spec.num_layers, True, lo, max(lo, hi), spec.planes * spec.head_bytes, pairs))
        elif isinstance(spec, StateSpec):
            paired, _ = paired_slots(request, gi)
            secs = tuple(_slices(s.channels, s.replicated, P.tp, D.tp) if paired else () for s in spec.sections)
            out.append(_Group(gi, spec.num_layers, False, sections=secs,
                              section_bytes=tuple(len(paired) * s.rows * s.unit_bytes for s in spec.sections),
                              p_slots=tuple(p for p, _, _ in paired), d_slots=tuple(d for _, d, _ in paired)))
        else:
            raise InternalError("a group is attention or state")
    return out


# ---- chunks ---------------------------------------------------------------------------------------------

class _Cost:
    """Bytes per P rank and per D rank of some piece (vectors), from per-pair bytes."""

    def __init__(self, p_tp: int, d_tp: int) -> None:
        self.p = np.zeros(p_tp, np.int64)
        self.d = np.zeros(d_tp, np.int64)

    def add(self, s: _Slice, nbytes: int) -> None:
        self.p[s.p] += nbytes
        self.d[s.d] += nbytes

    def fits(self, room_p: np.ndarray, room_d: np.ndarray) -> int:
        """How many copies of this cost fit in the room (a large number when it costs nothing)."""
        k = 1 << 62
        for cost, room in ((self.p, room_p), (self.d, room_d)):
            pos = cost > 0
            if pos.any():
                k = min(k, int((room[pos] // cost[pos]).min()))
        return k

    def largest(self) -> int:
        return int(max(self.p.max(initial=0), self.d.max(initial=0)))


def _token_cost(g: _Group, p_tp: int, d_tp: int) -> _Cost:
    c = _Cost(p_tp, d_tp)
    for s in g.pairs:
        c.add(s, s.n * g.unit)
    return c


def _section_cost(g: _Group, si: int, p_tp: int, d_tp: int) -> _Cost:
    c = _Cost(p_tp, d_tp)
    for s in g.sections[si]:
        c.add(s, s.n * g.section_bytes[si])
    return c


def _layer_cost(g: _Group, p_tp: int, d_tp: int) -> _Cost:
    c = _Cost(p_tp, d_tp)
    if g.attention:
        tc = _token_cost(g, p_tp, d_tp)
        c.p, c.d = tc.p * (g.hi - g.lo), tc.d * (g.hi - g.lo)
        return c
    for si in range(len(g.sections)):
        sc = _section_cost(g, si, p_tp, d_tp)
        c.p += sc.p
        c.d += sc.d
    return c


def min_staging_bytes(pair: EnginePair, request: Request) -> int:
    """The smallest ``staging_bytes`` :func:`plan_packed` accepts for ``request``: the largest
    per-rank bytes of one token of one attention layer or one state section of one layer (0 when
    nothing moves)."""
    pair.check_request(request)
    P, D = pair.prefill, pair.decode
    need = 0
    for g in _groups(pair, request):
        if g.attention and g.pairs:
            need = max(need, _token_cost(g, P.tp, D.tp).largest())
        for si in range(len(g.sections)):
            need = max(need, _section_cost(g, si, P.tp, D.tp).largest())
    return need


def _token_ranges(lo: int, hi: int, per_chunk: int, grid_first: int, grid: int) -> list[tuple[int, int]]:
    """Cut [lo, hi) into ranges of at most ``per_chunk`` tokens, ending on the grid (tokens
    ``grid_first + i * grid``) whenever a grid point is in reach."""
    out = []
    a = lo
    while a < hi:
        b = min(hi, a + per_chunk)
        if b < hi and per_chunk >= grid:
            on_grid = grid_first + (b - grid_first) // grid * grid
            if on_grid > a:
                b = on_grid
        out.append((a, b))
        a = b
    return out


def _chunk_pieces(pair: EnginePair, request: Request, groups: Sequence[_Group],
                  staging_bytes: int) -> list[list[ChunkPiece]]:
    """Pieces filled greedily into chunks whose bytes on every rank stay within ``staging_bytes``."""
    P, D = pair.prefill, pair.decode
    chunks: list[list[ChunkPiece]] = [[]]
    room_p = np.full(P.tp, staging_bytes, np.int64)
    room_d = np.full(D.tp, staging_bytes, np.int64)

    def close() -> None:
        chunks.append([])
        room_p[:] = staging_bytes
        room_d[:] = staging_bytes

    def take(piece: ChunkPiece, cost: _Cost, times: int = 1) -> None:
        chunks[-1].append(piece)
        room_p[:] -= cost.p * times
        room_d[:] -= cost.d * times

    for g in groups:
        if (g.attention and not g.pairs) or (not g.attention and not g.p_slots):
            continue
        per_layer = _layer_cost(g, P.tp, D.tp)
        layer = 0
        while layer < g.layers:
            k = min(per_layer.fits(room_p, room_d), g.layers - layer)
            if k >= 1:
                take(_piece(g, layer, layer + k), per_layer, k)
                layer += k
                continue
            if chunks[-1]:
                close()
                continue
            # one layer does not fit an empty chunk: cut it
            if g.attention:
                per_token = _token_cost(g, P.tp, D.tp)
                t = per_token.fits(room_p, room_d)
                if t < 1:
                    raise _too_small(pair, request, staging_bytes)
                listing = request.groups[g.index].decode
                if not isinstance(listing, BlockList):
                    raise InternalError("an attention group lists BlockLists")
                for a, b in _token_ranges(g.lo, g.hi, t, listing.first_token, D.kernel_block_tokens):
                    if chunks[-1]:
                        close()
                    take(ChunkPiece(g.index, layer, layer + 1, a, b), per_token, b - a)
            else:
                si = 0
                while si < len(g.sections):
                    sc = _section_cost(g, si, P.tp, D.tp)
                    if sc.fits(room_p, room_d) >= 1:
                        # extend the current piece while the next sections fit too
                        stop = si + 1
                        take_cost = sc
                        while stop < len(g.sections):
                            nxt = _section_cost(g, stop, P.tp, D.tp)
                            both = _Cost(P.tp, D.tp)
                            both.p, both.d = take_cost.p + nxt.p, take_cost.d + nxt.d
                            if both.fits(room_p, room_d) < 1:
                                break
                            take_cost = both
                            stop += 1
                        take(ChunkPiece(g.index, layer, layer + 1, section_start=si, section_stop=stop), take_cost)
                        si = stop
                    elif chunks[-1]:
                        close()
                    else:
                        raise _too_small(pair, request, staging_bytes)
            close()
            layer += 1
    return [c for c in chunks if c]


def _piece(g: _Group, l0: int, l1: int) -> ChunkPiece:
    if g.attention:
        return ChunkPiece(g.index, l0, l1, g.lo, g.hi)
    return ChunkPiece(g.index, l0, l1, section_start=0, section_stop=len(g.sections))


def _too_small(pair: EnginePair, request: Request, staging_bytes: int) -> StagingCapacityError:
    need = min_staging_bytes(pair, request)
    return StagingCapacityError("staging_bytes", f"{staging_bytes} B per rank cannot hold one token of one attention "
                                f"layer or one state section of one layer ({need} B on the busiest rank)",
                                actual=staging_bytes, expected=f">= {need}",
                                fix=f"plan with staging_bytes >= {need} (kvgeom.planning.min_staging_bytes)")


# ---- the staging layout of one piece --------------------------------------------------------------------

def _pair_bytes(g: _Group, piece: ChunkPiece, s: _Slice, section: int | None = None) -> int:
    layers = piece.layer_stop - piece.layer_start
    if g.attention:
        return layers * (piece.token_stop - piece.token_start) * s.n * g.unit
    return layers * s.n * g.section_bytes[section if section is not None else 0]


def _state_pair_sections(g: _Group, piece: ChunkPiece, p: int, d: int) -> list[tuple[int, _Slice]]:
    out = []
    for si in range(piece.section_start, piece.section_stop):
        for s in g.sections[si]:
            if s.p == p and s.d == d:
                out.append((si, s))
    return out


def _block_bytes(g: _Group, piece: ChunkPiece, p: int, d: int) -> int:
    if g.attention:
        return sum(_pair_bytes(g, piece, s) for s in g.pairs if s.p == p and s.d == d)
    return sum(_pair_bytes(g, piece, s, si) for si, s in _state_pair_sections(g, piece, p, d))


def _by_page_bytes(regions: np.ndarray, page_bytes: np.ndarray) -> list[np.ndarray]:
    """Layer-entry indices grouped by their region's page size (one step per group)."""
    sizes = page_bytes[regions]
    return [np.flatnonzero(sizes == v) for v in np.unique(sizes)]


@attrs.frozen(eq=False)
class _TokenMap:
    """One token range of one group: unpack classes (first D slot, tokens, D pages, tokens before each
    page) and pack classes (P slot, tokens, tokens of the D page, P pages, tokens before that D page,
    slots into it)."""

    unpack: list[tuple[int, int, np.ndarray, np.ndarray]]
    pack: list[tuple[int, int, int, np.ndarray, np.ndarray, np.ndarray]]


class _Builder:
    """Steps and wire rows of one plan (see the module docstring)."""

    def __init__(self, pair: EnginePair, request: Request) -> None:
        self.pair = pair
        self.request = request
        self.packs: list[StagingStep] = []
        self.unpacks: list[StagingStep] = []
        self._tokens: dict[tuple[int, int, int], _TokenMap] = {}
        self._side_views: dict[int, tuple[SideView, SideView]] = {}
        self._planes: dict[int, tuple[int, int]] = {}
        self._entries: dict[tuple[str, int, int, int], tuple[np.ndarray, np.ndarray]] = {}
        self._pb = {side: np.array([r.page_bytes for r in e.regions], np.int64)
                    for side, e in (("prefill", pair.prefill), ("decode", pair.decode))}
        self._uniform = {side: len(set(pb.tolist())) == 1 for side, pb in self._pb.items()}

    def _add(self, side: str, chunk: int, s: _Slice, regions: np.ndarray, offsets: np.ndarray, staged: np.ndarray,
             pages: np.ndarray, page_staged: np.ndarray, modes: list[Mode], unit: int, page_scale: int = 1) -> None:
        """Fold ``modes`` (cache stride, staging stride) and append one step per page size."""
        if not len(pages) or not len(regions):
            return
        run, rest = fold_modes(unit, modes)
        shape = tuple(m[0] for m in rest)
        cache = tuple(m[1][0] for m in rest)
        staging = tuple(m[1][1] for m in rest)
        out = self.packs if side == "prefill" else self.unpacks
        groups = [np.arange(len(regions))] if self._uniform[side] else _by_page_bytes(regions, self._pb[side])
        for sel in groups:
            out.append(StagingStep(side, chunk, s.p, s.d, regions[sel], offsets[sel], staged[sel], pages,
                                   page_staged, int(self._pb[side][regions[sel[0]]]) * page_scale, shape, cache,
                                   staging, run))

    def _token_map(self, g: int, a: int, b: int) -> _TokenMap:
        """D page entries and P x D segments of group ``g``'s tokens [a, b), by class (cached: every
        layer range of a group shares its token range)."""
        key = (g, a, b)
        if key not in self._tokens:
            lg = self.request.groups[g]
            if not (isinstance(lg.prefill, BlockList) and isinstance(lg.decode, BlockList)):
                raise InternalError("an attention group lists BlockLists")
            ps, ds = self._sides(g)
            pt = attrs.evolve(ps.tokens(lg.prefill), linear=False)
            dt = attrs.evolve(ds.tokens(lg.decode), linear=False)
            dsegs = segments(a, b, [dt])
            psegs = segments(a, b, [pt, dt])
            # tokens of the piece before each D page, and the D page each P x D segment lands in
            before = np.concatenate(([0], np.cumsum(dsegs.length)[:-1])).astype(np.int64)
            J = np.searchsorted(dsegs.start, psegs.start, side="right") - 1
            unpack = []
            keys = dsegs.slot[0] * (1 << 32) + dsegs.length
            for k in np.unique(keys):
                sel = np.flatnonzero(keys == k)
                unpack.append((int(dsegs.slot[0][sel[0]]), int(dsegs.length[sel[0]]), dsegs.page[0][sel], before[sel]))
            pack = []
            n_j = dsegs.length[J]
            keys = psegs.slot[0] * (1 << 40) + psegs.length * (1 << 20) + n_j
            for k in np.unique(keys):
                sel = np.flatnonzero(keys == k)
                jj = J[sel]
                pack.append((int(psegs.slot[0][sel[0]]), int(psegs.length[sel[0]]), int(n_j[sel[0]]),
                             psegs.page[0][sel], before[jj], psegs.slot[1][sel] - dsegs.slot[0][jj]))
            self._tokens[key] = _TokenMap(unpack, pack)
        return self._tokens[key]

    def _sides(self, g: int) -> tuple[SideView, SideView]:
        if g not in self._side_views:
            self._side_views[g] = (SideView(self.pair.prefill, g), SideView(self.pair.decode, g))
        return self._side_views[g]

    def attention(self, chunk: int, g: _Group, piece: ChunkPiece, s: _Slice, p_base: int, d_base: int) -> None:
        """Pack and unpack steps of one attention piece for pair ``s``, its block part starting at
        ``p_base`` in P's slot and ``d_base`` in D's."""
        spec = self.pair.model.groups[g.index]
        if not isinstance(spec, AttentionSpec):
            raise InternalError("dispatched on kind")
        tm = self._token_map(g.index, piece.token_start, piece.token_stop)
        ps, ds = self._sides(g.index)
        hb, planes = spec.head_bytes, spec.planes
        dl, pl = ds.layout, ps.layout
        dpk, ppk = self._planes_in_page(g.index)
        ntok = piece.token_stop - piece.token_start
        e_plane = s.n * ntok * hb  # one plane of one layer of the piece
        e_layer = planes * e_plane
        layers = range(piece.layer_start, piece.layer_stop)
        lam = np.arange(len(layers), dtype=np.int64)
        # D's in-page order of (plane, head, token), outermost first by D's strides
        d_modes = [(dl.kv_stride if dpk == 2 else 0, 0), (dl.head_stride, 1), (dl.token_stride, 2)]
        order = [m for _, m in sorted(d_modes, key=lambda x: (-x[0], x[1]))]

        def compact(n_tokens: int) -> tuple[int, ...]:
            return dense_strides((dpk, s.n, n_tokens), order, hb)

        block = dpk * s.n * hb  # staging bytes of one token's slice of one D page
        # ---- unpack: D pages, classes (first slot, tokens)
        d_reg, d_off = self._layer_entries("decode", g.index, layers, dpk == planes, planes, dl.kv_stride)
        if dpk == planes:
            d_staged = d_base + lam * e_layer
        else:
            d_staged = d_base + np.arange(len(d_reg), dtype=np.int64) * e_plane
        d_off = d_off + s.d0 * dl.head_stride
        for slot, n, pages, before in tm.unpack:
            st = compact(n)
            modes: list[Mode] = [(dpk, (dl.kv_stride, st[0])), (s.n, (dl.head_stride, st[1])),
                                 (n, (dl.token_stride, st[2]))]
            self._add("decode", chunk, s, d_reg, d_off + slot * dl.token_stride, d_staged, pages, before * block,
                      modes, hb)
        # ---- pack: P x D segments, classes (P slot, tokens, tokens of the D page)
        p_reg, p_off = self._layer_entries("prefill", g.index, layers, ppk == planes, planes, pl.kv_stride)
        p_off = p_off + s.p0 * pl.head_stride
        for slot, n, nj, pages, before, in_page in tm.pack:
            st = compact(nj)
            kv_staging = st[0] if dpk == 2 else e_plane
            if ppk == planes:
                p_staged = p_base + lam * e_layer
            else:
                p_staged = p_base + np.repeat(lam * e_layer, planes) + np.tile(np.arange(planes), len(lam)) \
                    * kv_staging
            modes = [(ppk, (pl.kv_stride, kv_staging)), (s.n, (pl.head_stride, st[1])), (n, (pl.token_stride, st[2]))]
            self._add("prefill", chunk, s, p_reg, p_off + slot * pl.token_stride, p_staged, pages,
                      before * block + in_page * st[2], modes, hb)

    def _planes_in_page(self, g: int) -> tuple[int, int]:
        """Planes inside one page on D and on P (2 when K and V share a region, else 1)."""
        if g not in self._planes:
            planes = self.pair.model.groups[g]
            n = planes.planes if isinstance(planes, AttentionSpec) else 1
            ps, ds = self._sides(g)
            self._planes[g] = (n if n == 2 and ds.planes_share_region() else 1,
                               n if n == 2 and ps.planes_share_region() else 1)
        return self._planes[g]

    def _layer_entries(self, side: str, g: int, layers: range, one_per_layer: bool, planes: int,
                       kv_stride: int) -> tuple[np.ndarray, np.ndarray]:
        """(region, in-page offset) of every layer entry: one per layer, or (layer, plane) pairs."""
        key = (side, g, layers.start, layers.stop)
        if key not in self._entries:
            ps, ds = self._sides(g)
            views = (ps if side == "prefill" else ds).views
            if one_per_layer:
                reg = [views[lv].regions[0] for lv in layers]
                off = [views[lv].offset for lv in layers]
            else:
                reg = [views[lv].regions[k] for lv in layers for k in range(planes)]
                off = [views[lv].offset + k * kv_stride for lv in layers for k in range(planes)]
            self._entries[key] = (np.array(reg, np.int64), np.array(off, np.int64))
        return self._entries[key]

    def state(self, chunk: int, g: _Group, piece: ChunkPiece, p: int, d: int, p_base: int, d_base: int) -> None:
        """Pack and unpack steps of one state piece for the pair (p, d)."""
        P, D = self.pair.prefill, self.pair.decode
        spec = self.pair.model.groups[g.index]
        pgeo, dgeo = P.groups[g.index], D.groups[g.index]
        if not (isinstance(spec, StateSpec) and isinstance(pgeo, StateGroupGeometry)
                and isinstance(dgeo, StateGroupGeometry)):
            raise InternalError("dispatched on kind")
        secs = _state_pair_sections(g, piece, p, d)
        if not secs:
            return
        per_slot = [s.n * spec.sections[si].rows * spec.sections[si].unit_bytes for si, s in secs]
        e_layer = sum(per_slot) * len(g.p_slots)
        layers = range(piece.layer_start, piece.layer_stop)
        lam = np.arange(len(layers), dtype=np.int64)
        k = np.arange(len(g.p_slots), dtype=np.int64)
        p_places, d_places = P.state_sections(g.index), D.state_sections(g.index)
        sec_base = 0
        for (si, s), slot_bytes in zip(secs, per_slot, strict=True):
            sec = spec.sections[si]
            pp, dp = p_places[si], d_places[si]
            st_ch, st_row = sec.rows * sec.unit_bytes, sec.unit_bytes
            for side, geo, place, c0, slots, base in (("prefill", pgeo, pp, s.p0, g.p_slots, p_base),
                                                     ("decode", dgeo, dp, s.d0, g.d_slots, d_base)):
                engine = P if side == "prefill" else D
                reg = np.array([geo.views[lv].region for lv in layers], np.int64)
                off = np.array([geo.views[lv].offset for lv in layers], np.int64) + place.offset \
                    + c0 * place.channel_stride
                modes: list[Mode] = [(s.n, (place.channel_stride, st_ch)), (sec.rows, (place.row_stride, st_row))]
                self._add(side, chunk, s, reg, off, base + lam * e_layer + sec_base, np.asarray(slots, np.int64),
                          k * slot_bytes, modes, sec.unit_bytes, engine.blocks_per_logical)
            sec_base += slot_bytes * len(g.p_slots)


@attrs.frozen(eq=False)
class PackedParts:
    """A packed plan's parts (before the TransferPlan is assembled)."""

    packs: tuple[StagingStep, ...]
    unpacks: tuple[StagingStep, ...]
    wire: WireCopies
    chunks: tuple[Chunk, ...]
    zeros: Zeros
    notes: tuple[Note, ...]
    staging_bytes: int


@attrs.frozen
class PackedCount:
    """What :func:`count_packed` finds without building steps (what auto's cost model needs)."""

    chunks: int
    wire_rows: int
    bytes: int
    operations: int  # pack and unpack (layer entry, class) pairs: the torch operations on fresh pages


def _layout(pair: EnginePair, request: Request, staging_bytes: int
            ) -> tuple[list[_Group], list[list[ChunkPiece]], list[dict[tuple[int, int], int]]]:
    check_int("staging_bytes", staging_bytes, minimum=1)
    pair.check_request(request)
    groups = _groups(pair, request)
    chunks = _chunk_pieces(pair, request, groups, staging_bytes)
    blocks: list[dict[tuple[int, int], int]] = []
    for pieces in chunks:
        per: dict[tuple[int, int], int] = {}
        for piece in pieces:
            g = groups[piece.group]
            for p in range(pair.prefill.tp):
                for d in range(pair.decode.tp):
                    n = _block_bytes(g, piece, p, d)
                    if n:
                        per[(p, d)] = per.get((p, d), 0) + n
        blocks.append(per)
    return groups, chunks, blocks


def count_packed(pair: EnginePair, request: Request, staging_bytes: int = DEFAULT_STAGING_BYTES) -> PackedCount:
    """Chunks, wire rows, bytes and an operation count of the packed plan, without building steps."""
    groups, chunks, blocks = _layout(pair, request, staging_bytes)
    ops = 0
    for pieces in chunks:
        for piece in pieces:
            g = groups[piece.group]
            layers = piece.layer_stop - piece.layer_start
            if g.attention:
                ops += 2 * layers * len(g.pairs)
            else:
                ops += 2 * layers * sum(len(g.sections[si]) for si in range(piece.section_start, piece.section_stop))
    return PackedCount(len(chunks), sum(len(b) for b in blocks), sum(sum(b.values()) for b in blocks), ops)


def plan_packed(pair: EnginePair, request: Request, staging_bytes: int = DEFAULT_STAGING_BYTES) -> PackedParts:
    """Pack steps, wire rows, unpack steps, chunks, zeros and notes of ``request`` (every group
    packed); raises :class:`~kvgeom.errors.StagingCapacityError` when ``staging_bytes`` cannot hold
    the smallest piece."""
    groups, chunks, blocks = _layout(pair, request, staging_bytes)
    P, D = pair.prefill, pair.decode
    b = _Builder(pair, request)
    wire: list[tuple[int, int, int, int, int, int]] = []
    for c, (pieces, per) in enumerate(zip(chunks, blocks, strict=True)):
        p_base = {}
        for p in range(P.tp):
            at = 0
            for d in range(D.tp):
                p_base[(p, d)] = at
                at += per.get((p, d), 0)
        d_base = {}
        for d in range(D.tp):
            at = 0
            for p in range(P.tp):
                d_base[(p, d)] = at
                at += per.get((p, d), 0)
        inside: dict[tuple[int, int], int] = {}  # bytes of the pair's block already laid out
        for piece in pieces:
            g = groups[piece.group]
            if g.attention:
                for s in g.pairs:
                    key = (s.p, s.d)
                    at = inside.get(key, 0)
                    b.attention(c, g, piece, s, p_base[key] + at, d_base[key] + at)
                    inside[key] = at + _pair_bytes(g, piece, s)
            else:
                for (p, d) in sorted(per):
                    n = sum(_pair_bytes(g, piece, s, si) for si, s in _state_pair_sections(g, piece, p, d))
                    if n:
                        at = inside.get((p, d), 0)
                        b.state(c, g, piece, p, d, p_base[(p, d)] + at, d_base[(p, d)] + at)
                        inside[(p, d)] = at + n
        for (p, d), n in sorted(per.items()):
            wire.append((c, p, p_base[(p, d)], d, d_base[(p, d)], n))
    cols = np.array(wire, np.int64).reshape(-1, 6)
    wire_rows = WireCopies(*(cols[:, i] for i in range(6)))
    chunk_list = tuple(Chunk(i, tuple(pieces)) for i, pieces in enumerate(chunks))
    zeros, notes = _zeros_and_notes(pair, request, groups)
    used_p = np.zeros((len(chunks), P.tp), np.int64)
    used_d = np.zeros((len(chunks), D.tp), np.int64)
    if len(cols):
        np.add.at(used_p, (cols[:, 0], cols[:, 1]), cols[:, 5])
        np.add.at(used_d, (cols[:, 0], cols[:, 3]), cols[:, 5])
    shown = "; ".join(str(ch) for ch in chunk_list[:3]) + (f"; ... ({len(chunk_list)} chunks)" if len(chunk_list) > 3
                                                             else "")
    notes.append(Note(NoteKind.CHUNKS, f"packed: {len(chunk_list)} chunk{'s' if len(chunk_list) != 1 else ''} of at "
                      f"most {format_bytes(staging_bytes)} per rank ({shown}); staging up to "
                      f"{format_bytes(int(used_p.max(initial=0)))} per P rank and "
                      f"{format_bytes(int(used_d.max(initial=0)))} per D rank; {len(wire_rows)} wire rows for "
                      f"{format_bytes(wire_rows.total_bytes)}"))
    return PackedParts(tuple(b.packs), tuple(b.unpacks), wire_rows, chunk_list, zeros, tuple(notes), staging_bytes)


def _zeros_and_notes(pair: EnginePair, request: Request, groups: Sequence[_Group]) -> tuple[Zeros, list[Note]]:
    zeros: list[Zeros] = []
    notes: list[Note] = []
    for g in groups:
        spec = pair.model.groups[g.index]
        if g.attention:
            if g.pairs:
                notes.append(Note(NoteKind.PACKED, f"{spec.name}: tokens [{g.lo}, {g.hi}) of {g.layers} layers move "
                                  f"through staging for {len(g.pairs)} (P rank, D rank) pairs, in D's page order"))
            else:
                notes.append(Note(NoteKind.NOTHING_TO_MOVE,
                                  f"{spec.name}: no token is both listed by P (computed) and needed by D"))
            z, zn = attention_zeros(pair, request, g.index)
            if len(z):
                zeros.append(z)
            notes.extend(zn)
        else:
            notes.extend(state_notes(pair, request, g.index))
            if g.p_slots:
                notes.append(Note(NoteKind.PACKED, f"{spec.name}: {len(g.p_slots)} paired slot(s) of {g.layers} layers "
                                  "move through staging, section by section"))
    return (Zeros.concat(zeros) if zeros else Zeros.empty()), notes
