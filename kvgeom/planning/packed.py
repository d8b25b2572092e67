"""The packed strategy: gather on P, a few large wire rows, scatter on D (docs/design.md §12).

Every group (attention and state) moves through staging. Per chunk, P rank p packs what each D
rank needs into its slot, one wire row per (P rank, D rank) crosses, D rank d unpacks::

    request --pieces--> chunks (layers of a group; token ranges or sections when one layer does not fit)
      chunk c, pair (p, d):  pack steps   P cache pages -> P slot   (cut at P and D pages)
                             wire row     P slot [p_base, +n) -> D slot [d_base, +n)
                             unpack steps D slot -> D cache pages   (cut at D pages only)
    then the zeros of the direct strategy (kvgeom.planning.attention.attention_zeros)

Which P rank feeds which D rank is the direct planner's rule (docs/design.md §3.3 and §11.3): per
flat D rank, the layers of its stage split by the P stage holding them, the heads of its head
group from the P head groups ``sources`` picks, the tokens both sides' DCP ranks own, one P
replica. A pair (p, d) therefore carries a layer range, a head (or channel) slice and, with DCP, an
owner on each side.

Staging is dense and in D's order (§12.2): a (p, d) block is the chunk's pieces in order; an
attention piece is layer entries x D pages x D's in-page order of (plane, head, token) restricted
to the pair's heads and tokens; a state piece is layers x sections x paired slots x [channel
slice][rows][unit]. Steps are grouped by *class*, the entries that share one strided pattern:
unpacks by (first slot, tokens, tokens of the page's block), packs by (P slot, tokens, tokens of
the D page's block they land in). Runs of one page in one slot step (a DCP rank's every other
slot) fold into one entry with a ``count x step`` mode, so classes also key on (count, step).

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
from ..arith.tokens import Segments, SideTokens, segments
from ..errors import InternalError, StagingCapacityError
from ..values.fields import check_int
from ..values.layout import StateGroupGeometry
from ..values.model import AttentionSpec, StateSpec
from ..values.notes import Note, NoteKind
from ..values.pair import EnginePair
from ..values.plan import Copies, TransferPlan, Zeros
from ..values.request import BlockList, Request
from ..values.staging import Chunk, ChunkPiece, StagingStep, WireCopies
from ..values.text import format_bytes
from .attention import attention_zeros, needed_tokens
from .coalesce import coalesce_zeros
from .sides import SideView, stage_parts
from .state import paired_slots, state_notes

__all__ = ["DEFAULT_STAGING_BYTES", "PackedParts", "PackedCount", "plan_packed", "count_packed",
           "min_staging_bytes", "packed_transfer_plan", "cuts_of", "class_counts"]

DEFAULT_STAGING_BYTES = 256 << 20
"""Default slot capacity per rank (bytes one chunk may stage on one rank): 256 MiB."""


@attrs.frozen
class _Slice:
    """What flat P rank ``p`` sends flat D rank ``d`` in one group: layers ``[l0, l1)``, ``n``
    items (heads or channels) starting at local item ``p0`` on P and ``d0`` on D, and (attention)
    the tokens D's DCP rank ``dr`` and P's DCP rank ``po`` both own."""

    p: int
    d: int
    n: int
    p0: int
    d0: int
    l0: int
    l1: int
    dr: int = 0
    po: int = 0


@attrs.frozen(eq=False)
class _Group:
    """What one group moves, per (P rank, D rank) pair."""

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


def _attention_pairs(pair: EnginePair, g: int, spec: AttentionSpec) -> tuple[_Slice, ...]:
    """Every (P rank, D rank) pair of an attention group (the direct planner's rule, §11.3)."""
    P, D = pair.prefill, pair.decode
    H = spec.num_kv_heads
    p_dcp, d_dcp, p_reps = P.topology.dcp, D.topology.dcp, P.topology.replicas
    out = []
    for d in range(D.num_ranks):
        c = D.coords(d)
        d_layers = D.stage_layers(g, c.stage)
        if d_layers.size == 0:
            continue
        d_slice = D.head_slice(g, d)
        q = d // d_dcp + d % d_dcp  # the spreading key of docs/design.md §11.3
        srcs = sources(H, p_tp=P.head_tp, p_replicated=spec.replicated, d_tp=D.head_tp, d_rank=c.head_group,
                       d_replicated=spec.replicated, spread=q // p_reps)
        for p_stage, layers in stage_parts(P, g, d_layers):
            for po in range(p_dcp):
                for src in srcs:
                    p = P.rank_of(p_stage, src.p_rank * p_dcp + po, q % p_reps)
                    p_slice = owned_slice(H, P.head_tp, src.p_rank, replicated=spec.replicated)
                    out.append(_Slice(p, d, src.items.size, src.items.start - p_slice.start,
                                      src.items.start - d_slice.start, layers.start, layers.stop, c.dcp_rank, po))
    return tuple(sorted(out, key=lambda s: (s.d, s.p)))


def _state_pairs(pair: EnginePair, g: int, spec: StateSpec) -> tuple[tuple[_Slice, ...], ...]:
    """Per section, every (P rank, D rank) pair of a state group (channels over the full TP, §11.3)."""
    P, D = pair.prefill, pair.decode
    p_reps = P.topology.replicas
    out = []
    for sec in spec.sections:
        pairs = []
        for d in range(D.num_ranks):
            c = D.coords(d)
            d_layers = D.stage_layers(g, c.stage)
            if d_layers.size == 0:
                continue
            d_slice = owned_slice(sec.channels, D.tp, c.tp_rank, replicated=sec.replicated)
            q = d // D.topology.dcp + d % D.topology.dcp
            srcs = sources(sec.channels, p_tp=P.tp, p_replicated=sec.replicated, d_tp=D.tp, d_rank=c.tp_rank,
                           d_replicated=sec.replicated, spread=q // p_reps)
            for p_stage, layers in stage_parts(P, g, d_layers):
                for src in srcs:
                    p_slice = owned_slice(sec.channels, P.tp, src.p_rank, replicated=sec.replicated)
                    pairs.append(_Slice(P.rank_of(p_stage, src.p_rank, q % p_reps), d, src.items.size,
                                        src.items.start - p_slice.start, src.items.start - d_slice.start,
                                        layers.start, layers.stop))
        out.append(tuple(sorted(pairs, key=lambda s: (s.d, s.p))))
    return tuple(out)


def _groups(pair: EnginePair, request: Request) -> list[_Group]:
    out: list[_Group] = []
    for gi, spec in enumerate(pair.model.groups):
        if isinstance(spec, AttentionSpec):
            lo, hi = needed_tokens(request, pair, gi)
            pairs = _attention_pairs(pair, gi, spec) if hi > lo else ()
            out.append(_Group(gi, spec.num_layers, True, lo, max(lo, hi), spec.planes * spec.head_bytes, pairs))
        elif isinstance(spec, StateSpec):
            paired, _ = paired_slots(request, gi)
            secs = _state_pairs(pair, gi, spec) if paired else tuple(() for _ in spec.sections)
            out.append(_Group(gi, spec.num_layers, False, sections=secs,
                              section_bytes=tuple(len(paired) * s.rows * s.unit_bytes for s in spec.sections),
                              p_slots=tuple(p for p, _, _ in paired), d_slots=tuple(d for _, d, _ in paired)))
        else:
            raise InternalError("a group is attention or state")
    return out


# ---- tokens: which of a range each pair carries, and where -------------------------------------------

@attrs.frozen(eq=False)
class _TokenMap:
    """The tokens of one range that one (D DCP rank, P DCP rank) pair of owners carries.

    ``unpack``: per class (first D slot, tokens, tokens of the page's block) the D pages and the
    tokens before each entry in the pair's block order; ``pack``: per class (P slot, tokens, tokens
    of the D page's block) the P pages, the tokens before the D block and the entry's position in
    it. ``tokens`` is how many tokens the pair carries."""

    tokens: int
    unpack: list[tuple[int, int, int, int, int, np.ndarray, np.ndarray, np.ndarray]]
    pack: list[tuple[int, int, int, int, int, np.ndarray, np.ndarray, np.ndarray]]


def _runs(segs: Segments, side: int, block: np.ndarray, tau: np.ndarray) -> np.ndarray:
    """First index of each run of segments that continue one another on ``side`` (same page, next
    slot) and in the block (same block, next position): one entry each."""
    n = len(segs)
    if n == 0:
        return np.zeros(0, np.int64)
    cont = ((segs.page[side][1:] == segs.page[side][:-1])
            & (segs.slot[side][1:] == segs.slot[side][:-1] + segs.length[:-1])
            & (block[1:] == block[:-1]) & (tau[1:] == tau[:-1] + segs.length[:-1]))
    return np.flatnonzero(np.concatenate(([True], ~cont)))


def _merge(segs: Segments, heads: np.ndarray) -> Segments:
    length = np.add.reduceat(segs.length, heads) if len(heads) else segs.length[:0]
    return Segments(segs.start[heads], length, tuple(p[heads] for p in segs.page), tuple(s[heads] for s in segs.slot))


def _progressions(segs: Segments, side: int, block: np.ndarray, tau: np.ndarray
                  ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Fold the runs of one block and one ``side`` page into one entry when they have one length,
    slots in one step and follow one another in the block (a DCP rank's every other slot, §12.2):
    ``(head, count, slot step)`` per entry; other runs stay entries of their own (count 1, step 0)."""
    n = len(segs)
    if n < 2:
        return np.arange(n, dtype=np.int64), np.ones(n, np.int64), np.zeros(n, np.int64)
    page, slot, length = segs.page[side], segs.slot[side], segs.length
    new = np.concatenate(([True], (block[1:] != block[:-1]) | (page[1:] != page[:-1])))
    gid = np.cumsum(new) - 1
    first = np.flatnonzero(new)
    counts = np.diff(np.append(first, n))
    step = np.zeros(len(first), np.int64)
    multi = counts > 1
    step[multi] = slot[first[multi] + 1] - slot[first[multi]]
    link = ~new[1:]  # j -> j + 1 inside one group
    fits = (length[1:] == length[:-1]) & (tau[1:] - tau[:-1] == length[:-1]) & (slot[1:] - slot[:-1] == step[gid[1:]])
    bad = np.zeros(len(first), bool)
    bad[gid[1:][link & ~fits]] = True
    bad |= step < 0
    heads = np.flatnonzero(new | bad[gid])
    g = gid[heads]
    return heads, np.where(bad[g], 1, counts[g]), np.where(bad[g], 0, step[g])


def _classes(segs: Segments, side: int, block: np.ndarray, tau: np.ndarray, block_tokens: np.ndarray,
             block_before: np.ndarray) -> list[tuple[int, int, int, int, int, np.ndarray, np.ndarray, np.ndarray]]:
    """Runs of ``segs`` folded (:func:`_progressions`) and grouped into classes of one strided
    pattern: (first slot, tokens, count, slot step, tokens of the D block) with, per entry, the
    ``side`` page, the tokens before its D block and its position in the block."""
    heads = _runs(segs, side, block, tau)
    run = _merge(segs, heads)
    rblock, rtau = block[heads], tau[heads]
    at, count, step = _progressions(run, side, rblock, rtau)
    slot, length, page = run.slot[side][at], run.length[at], run.page[side][at]
    eblock, etau = rblock[at], rtau[at]
    nj = block_tokens[eblock] if len(at) else eblock
    out = []
    ids = np.zeros(len(at), np.int64)
    for col in (slot, length, count, step, nj):  # one id per distinct key, column by column
        _, inv = np.unique(col, return_inverse=True)
        _, ids = np.unique(ids * (int(inv.max(initial=0)) + 1) + inv.reshape(-1), return_inverse=True)
        ids = ids.reshape(-1)
    order = np.argsort(ids, kind="stable")
    cuts = np.flatnonzero(np.diff(ids[order])) + 1
    for sel in np.split(order, cuts) if len(order) else []:
        i = int(sel[0])
        out.append((int(slot[i]), int(length[i]), int(count[i]), int(step[i]), int(nj[i]), page[sel],
                    block_before[eblock[sel]], etau[sel]))
    return out


@attrs.frozen(eq=False)
class _Cuts:
    """The segments of one token range, before they are split by owners: ``d`` cut at D pages (and
    DCP chunks) and where P's DCP owner changes, ``p`` cut at both sides' pages and DCP chunks; the
    owners (D DCP rank, P DCP rank) of each segment."""

    d: Segments
    d_owner: tuple[np.ndarray, np.ndarray]
    p: Segments
    p_owner: tuple[np.ndarray, np.ndarray]

    def tokens(self, dr: int, po: int) -> int:
        return int(self.d.length[(self.d_owner[0] == dr) & (self.d_owner[1] == po)].sum())


def _cuts(ps: SideView, ds: SideView, request: Request, g: int, a: int, b: int) -> _Cuts:
    lg = request.groups[g]
    if not (isinstance(lg.prefill, BlockList) and isinstance(lg.decode, BlockList)):
        raise InternalError("an attention group lists BlockLists")
    pt = attrs.evolve(ps.tokens(lg.prefill), linear=False)
    dt = attrs.evolve(ds.tokens(lg.decode), linear=False)
    return cuts_of(pt, dt, a, b)


def cuts_of(pt: SideTokens, dt: SideTokens, a: int, b: int) -> _Cuts:
    """The segments of tokens ``[a, b)`` on P's and D's listings (each cut at every kernel page)."""
    dsegs = segments(a, b, [dt] + ([pt] if pt.cp > 1 else []))
    psegs = segments(a, b, [pt, dt])
    return _Cuts(dsegs, (dt.owner(dsegs.start), pt.owner(dsegs.start)),
                 psegs, (dt.owner(psegs.start), pt.owner(psegs.start)))


def class_counts(cuts: _Cuts, dr: int, po: int) -> tuple[int, int, int]:
    """(classes, page entries, most entries in one D page) of the (D DCP rank, P DCP rank) pair's
    tokens in ``cuts``, unpacks and packs together: the steps one (P rank, D rank) pair of those
    owners makes per page size, and the pages they list (what the work budget counts,
    :mod:`kvgeom.planning.budget`)."""
    tm = _token_map(cuts, dr, po)
    most = 0
    for side in (tm.unpack, tm.pack):
        if side:
            _, per_page = np.unique(np.concatenate([c[6] for c in side]), return_counts=True)
            most += int(per_page.max())
    classes = tm.unpack + tm.pack
    return len(classes), sum(len(c[5]) for c in classes), most


def _token_map(cuts: _Cuts, dr: int, po: int) -> _TokenMap:
    # D side: the pair's tokens, cut at D pages
    dsegs = cuts.d.take(np.flatnonzero((cuts.d_owner[0] == dr) & (cuts.d_owner[1] == po)))
    # blocks: one per D page, in token order; tokens before each segment in its block and overall
    new_page = np.concatenate(([True], dsegs.page[0][1:] != dsegs.page[0][:-1])) if len(dsegs) else \
        np.zeros(0, bool)
    block = np.cumsum(new_page) - 1
    before = np.concatenate(([0], np.cumsum(dsegs.length)[:-1])).astype(np.int64)  # tokens before each segment
    block_first = np.flatnonzero(new_page)
    block_before = before[block_first]  # tokens before each block
    tau = before - block_before[block]  # position of each segment inside its block
    block_tokens = np.diff(np.append(block_before, int(dsegs.length.sum()))) if len(dsegs) else before
    unpack = _classes(dsegs, 0, block, tau, block_tokens, block_before)
    # P side: the pair's tokens cut at both sides' pages, each inside one D segment
    psegs = cuts.p.take(np.flatnonzero((cuts.p_owner[0] == dr) & (cuts.p_owner[1] == po)))
    host = np.searchsorted(dsegs.start, psegs.start, side="right") - 1
    p_block = block[host] if len(psegs) else host
    p_tau = tau[host] + (psegs.start - dsegs.start[host]) if len(psegs) else host
    pack = _classes(psegs, 0, p_block, p_tau, block_tokens, block_before)
    return _TokenMap(int(dsegs.length.sum()), unpack, pack)


# ---- chunks ---------------------------------------------------------------------------------------------

class _Costs:
    """Bytes per layer on every P rank and D rank of one group's piece: ``[layers, ranks]``."""

    def __init__(self, layers: int, p_ranks: int, d_ranks: int) -> None:
        self.p = np.zeros((layers, p_ranks), np.int64)
        self.d = np.zeros((layers, d_ranks), np.int64)

    def add(self, s: _Slice, nbytes: int) -> None:
        self.p[s.l0:s.l1, s.p] += nbytes
        self.d[s.l0:s.l1, s.d] += nbytes

    def layers_fitting(self, first: int, room_p: np.ndarray, room_d: np.ndarray) -> int:
        """How many layers from ``first`` on fit in the rooms together."""
        cum_p = np.cumsum(self.p[first:], axis=0)
        cum_d = np.cumsum(self.d[first:], axis=0)
        ok = np.all(cum_p <= room_p[None, :], axis=1) & np.all(cum_d <= room_d[None, :], axis=1)
        return int(np.argmin(ok)) if not ok.all() else len(ok)

    def largest(self) -> int:
        return int(max(self.p.max(initial=0), self.d.max(initial=0)))


class _Planner:
    """The pair lists, token maps and costs of one plan (shared by chunking and step building)."""

    def __init__(self, pair: EnginePair, request: Request) -> None:
        self.pair = pair
        self.request = request
        self.groups = _groups(pair, request)
        self._maps: dict[tuple[int, int, int, int, int], _TokenMap] = {}
        self._cuts: dict[tuple[int, int, int], _Cuts] = {}
        self._sides: dict[int, tuple[SideView, SideView]] = {}

    def sides(self, g: int) -> tuple[SideView, SideView]:
        if g not in self._sides:
            self._sides[g] = (SideView(self.pair.prefill, g), SideView(self.pair.decode, g))
        return self._sides[g]

    def cuts(self, g: int, a: int, b: int) -> _Cuts:
        if (g, a, b) not in self._cuts:
            ps, ds = self.sides(g)
            self._cuts[(g, a, b)] = _cuts(ps, ds, self.request, g, a, b)
        return self._cuts[(g, a, b)]

    def token_map(self, g: int, a: int, b: int, dr: int, po: int) -> _TokenMap:
        key = (g, a, b, dr, po)
        if key not in self._maps:
            self._maps[key] = _token_map(self.cuts(g, a, b), dr, po)
        return self._maps[key]

    def tokens(self, g: _Group, s: _Slice, a: int, b: int) -> int:
        key = (g.index, a, b, s.dr, s.po)
        if key in self._maps:
            return self._maps[key].tokens
        return self.cuts(g.index, a, b).tokens(s.dr, s.po)

    def layer_costs(self, g: _Group, a: int = 0, b: int = 0) -> _Costs:
        """Bytes per layer and rank of the whole group (attention tokens [a, b), default [lo, hi))."""
        P, D = self.pair.prefill, self.pair.decode
        c = _Costs(g.layers, P.num_ranks, D.num_ranks)
        if g.attention:
            a, b = (g.lo, g.hi) if b <= a else (a, b)
            for s in g.pairs:
                c.add(s, self.tokens(g, s, a, b) * s.n * g.unit)
        else:
            for si in range(len(g.sections)):
                for s in g.sections[si]:
                    c.add(s, s.n * g.section_bytes[si])
        return c

    def token_bound(self, g: _Group) -> tuple[np.ndarray, np.ndarray]:
        """Per rank, at most the bytes one token of one layer stages (as if every token were every
        pair's): what cuts a layer into token ranges."""
        P, D = self.pair.prefill, self.pair.decode
        bp, bd = np.zeros(P.num_ranks, np.int64), np.zeros(D.num_ranks, np.int64)
        per_layer = _Costs(g.layers, P.num_ranks, D.num_ranks)
        for s in g.pairs:
            per_layer.add(s, s.n * g.unit)
        if g.layers:
            bp, bd = per_layer.p.max(axis=0), per_layer.d.max(axis=0)
        return bp, bd

    def section_costs(self, g: _Group, si: int, layer: int) -> tuple[np.ndarray, np.ndarray]:
        P, D = self.pair.prefill, self.pair.decode
        cp, cd = np.zeros(P.num_ranks, np.int64), np.zeros(D.num_ranks, np.int64)
        for s in g.sections[si]:
            if s.l0 <= layer < s.l1:
                cp[s.p] += s.n * g.section_bytes[si]
                cd[s.d] += s.n * g.section_bytes[si]
        return cp, cd


def min_staging_bytes(pair: EnginePair, request: Request) -> int:
    """The smallest ``staging_bytes`` :func:`plan_packed` accepts for ``request``: the largest
    per-rank bytes of one token of one attention layer or one state section of one layer (0 when
    nothing moves)."""
    pair.check_request(request)
    return _min_staging(_Planner(pair, request))


def _min_staging(pl: _Planner) -> int:
    need = 0
    for g in pl.groups:
        if g.attention and g.pairs:
            bp, bd = pl.token_bound(g)
            need = max(need, int(bp.max(initial=0)), int(bd.max(initial=0)))
        for si in range(len(g.sections)):
            for layer in range(g.layers):
                cp, cd = pl.section_costs(g, si, layer)
                need = max(need, int(cp.max(initial=0)), int(cd.max(initial=0)))
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


def _fits(cost_p: np.ndarray, cost_d: np.ndarray, room_p: np.ndarray, room_d: np.ndarray) -> int:
    """How many copies of this per-rank cost fit in the rooms (a large number when it costs nothing)."""
    k = 1 << 62
    for cost, room in ((cost_p, room_p), (cost_d, room_d)):
        pos = cost > 0
        if pos.any():
            k = min(k, int((room[pos] // cost[pos]).min()))
    return k


def _chunk_pieces(pl: _Planner, staging_bytes: int) -> list[list[ChunkPiece]]:
    """Pieces filled greedily into chunks whose bytes on every rank stay within ``staging_bytes``."""
    P, D = pl.pair.prefill, pl.pair.decode
    chunks: list[list[ChunkPiece]] = [[]]
    room_p = np.full(P.num_ranks, staging_bytes, np.int64)
    room_d = np.full(D.num_ranks, staging_bytes, np.int64)

    def close() -> None:
        chunks.append([])
        room_p[:] = staging_bytes
        room_d[:] = staging_bytes

    def take(piece: ChunkPiece, cost_p: np.ndarray, cost_d: np.ndarray) -> None:
        chunks[-1].append(piece)
        room_p[:] -= cost_p
        room_d[:] -= cost_d

    for g in pl.groups:
        if (g.attention and not g.pairs) or (not g.attention and not any(g.sections)):
            continue
        costs = pl.layer_costs(g)
        layer = 0
        while layer < g.layers:
            k = costs.layers_fitting(layer, room_p, room_d)
            if k >= 1:
                take(_piece(g, layer, layer + k), costs.p[layer:layer + k].sum(axis=0),
                     costs.d[layer:layer + k].sum(axis=0))
                layer += k
                continue
            if chunks[-1]:
                close()
                continue
            # one layer does not fit an empty chunk: cut it
            if g.attention:
                bp, bd = pl.token_bound(g)
                t = _fits(bp, bd, room_p, room_d)
                if t < 1:
                    raise _too_small(pl, staging_bytes)
                listing = pl.request.groups[g.index].decode
                if not isinstance(listing, BlockList):
                    raise InternalError("an attention group lists BlockLists")
                grid = D.kernel_block_tokens * D.topology.dcp  # D pages cover K x dcp request tokens
                for a, b in _token_ranges(g.lo, g.hi, t, listing.first_token, grid):
                    if chunks[-1]:
                        close()
                    part = pl.layer_costs(g, a, b)
                    take(ChunkPiece(g.index, layer, layer + 1, a, b), part.p[layer], part.d[layer])
            else:
                si = 0
                while si < len(g.sections):
                    cp, cd = pl.section_costs(g, si, layer)
                    if _fits(cp, cd, room_p, room_d) >= 1:
                        stop = si + 1  # extend the piece while the next sections fit too
                        while stop < len(g.sections):
                            np_, nd = pl.section_costs(g, stop, layer)
                            if _fits(cp + np_, cd + nd, room_p, room_d) < 1:
                                break
                            cp, cd = cp + np_, cd + nd
                            stop += 1
                        take(ChunkPiece(g.index, layer, layer + 1, section_start=si, section_stop=stop), cp, cd)
                        si = stop
                    elif chunks[-1]:
                        close()
                    else:
                        raise _too_small(pl, staging_bytes)
            close()
            layer += 1
    return [c for c in chunks if c]


def _piece(g: _Group, l0: int, l1: int) -> ChunkPiece:
    if g.attention:
        return ChunkPiece(g.index, l0, l1, g.lo, g.hi)
    return ChunkPiece(g.index, l0, l1, section_start=0, section_stop=len(g.sections))


def _too_small(pl: _Planner, staging_bytes: int) -> StagingCapacityError:
    need = _min_staging(pl)
    return StagingCapacityError("staging_bytes", f"{staging_bytes} B per rank cannot hold one token of one attention "
                                f"layer or one state section of one layer ({need} B on the busiest rank)",
                                actual=staging_bytes, expected=f">= {need}",
                                fix=f"plan with staging_bytes >= {need} (kvgeom.planning.min_staging_bytes)")


# ---- the staging layout of one piece --------------------------------------------------------------------

def _overlap(s: _Slice, piece: ChunkPiece) -> tuple[int, int]:
    """The layers of ``piece`` pair ``s`` carries: ``[l0, l1)`` (empty when l0 >= l1)."""
    return max(s.l0, piece.layer_start), min(s.l1, piece.layer_stop)


def _pair_bytes(pl: _Planner, g: _Group, piece: ChunkPiece, s: _Slice, section: int = 0) -> int:
    l0, l1 = _overlap(s, piece)
    if l1 <= l0:
        return 0
    if g.attention:
        return (l1 - l0) * pl.tokens(g, s, piece.token_start, piece.token_stop) * s.n * g.unit
    return (l1 - l0) * s.n * g.section_bytes[section]


def _state_pair_sections(g: _Group, piece: ChunkPiece, p: int, d: int) -> list[tuple[int, _Slice]]:
    out = []
    for si in range(piece.section_start, piece.section_stop):
        for s in g.sections[si]:
            l0, l1 = _overlap(s, piece)
            if s.p == p and s.d == d and l1 > l0:
                out.append((si, s))
    return out


def _by_page_bytes(regions: np.ndarray, page_bytes: np.ndarray) -> list[np.ndarray]:
    """Layer-entry indices grouped by their region's page size (one step per group)."""
    sizes = page_bytes[regions]
    return [np.flatnonzero(sizes == v) for v in np.unique(sizes)]


class _Builder:
    """Steps of one plan (see the module docstring)."""

    def __init__(self, pl: _Planner) -> None:
        self.pl = pl
        self.pair = pl.pair
        self.packs: list[StagingStep] = []
        self.unpacks: list[StagingStep] = []
        self._planes: dict[int, tuple[int, int]] = {}
        self._entries: dict[tuple[str, int, int, int], tuple[np.ndarray, np.ndarray]] = {}
        self._pb = {side: np.array([r.page_bytes for r in e.regions], np.int64)
                    for side, e in (("prefill", self.pair.prefill), ("decode", self.pair.decode))}
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

    def _planes_in_page(self, g: int) -> tuple[int, int]:
        """Planes inside one page on D and on P (2 when K and V share a region, else 1)."""
        if g not in self._planes:
            spec = self.pair.model.groups[g]
            n = spec.planes if isinstance(spec, AttentionSpec) else 1
            ps, ds = self.pl.sides(g)
            self._planes[g] = (n if n == 2 and ds.planes_share_region() else 1,
                               n if n == 2 and ps.planes_share_region() else 1)
        return self._planes[g]

    def _layer_entries(self, side: str, g: int, layers: range, one_per_layer: bool, planes: int,
                       kv_stride: int) -> tuple[np.ndarray, np.ndarray]:
        """(region, in-page offset) of every layer entry: one per layer, or (layer, plane) pairs."""
        key = (side, g, layers.start, layers.stop)
        if key not in self._entries:
            ps, ds = self.pl.sides(g)
            views = (ps if side == "prefill" else ds).views
            if one_per_layer:
                reg = [views[lv].regions[0] for lv in layers]
                off = [views[lv].offset for lv in layers]
            else:
                reg = [views[lv].regions[k] for lv in layers for k in range(planes)]
                off = [views[lv].offset + k * kv_stride for lv in layers for k in range(planes)]
            self._entries[key] = (np.array(reg, np.int64), np.array(off, np.int64))
        return self._entries[key]

    def attention(self, chunk: int, g: _Group, piece: ChunkPiece, s: _Slice, p_base: int, d_base: int) -> None:
        """Pack and unpack steps of one attention piece for pair ``s``, its block part starting at
        ``p_base`` in P's slot and ``d_base`` in D's."""
        spec = self.pair.model.groups[g.index]
        if not isinstance(spec, AttentionSpec):
            raise InternalError("dispatched on kind")
        l0, l1 = _overlap(s, piece)
        tm = self.pl.token_map(g.index, piece.token_start, piece.token_stop, s.dr, s.po)
        if l1 <= l0 or not tm.tokens:
            return
        ps, ds = self.pl.sides(g.index)
        hb, planes = spec.head_bytes, spec.planes
        dl, pl = ds.layout, ps.layout
        dpk, ppk = self._planes_in_page(g.index)
        e_plane = s.n * tm.tokens * hb  # one plane of one layer of the piece
        e_layer = planes * e_plane
        layers = range(l0, l1)
        lam = np.arange(len(layers), dtype=np.int64)
        # D's in-page order of (plane, head, token), outermost first by D's strides
        d_modes = [(dl.kv_stride if dpk == 2 else 0, 0), (dl.head_stride, 1), (dl.token_stride, 2)]
        order = [m for _, m in sorted(d_modes, key=lambda x: (-x[0], x[1]))]

        def compact(n_tokens: int) -> tuple[int, ...]:
            return dense_strides((dpk, s.n, n_tokens), order, hb)

        block = dpk * s.n * hb  # staging bytes of one token's slice of one D page
        # ---- unpack: the pair's tokens of each D page, classes (D slot, tokens, tokens of the block)
        d_reg, d_off = self._layer_entries("decode", g.index, layers, dpk == planes, planes, dl.kv_stride)
        if dpk == planes:
            d_staged = d_base + lam * e_layer
        else:
            d_staged = d_base + np.arange(len(d_reg), dtype=np.int64) * e_plane
        d_off = d_off + s.d0 * dl.head_stride
        for slot, n, count, step, nj, pages, before, tau in tm.unpack:
            st = compact(nj)
            modes: list[Mode] = [(dpk, (dl.kv_stride, st[0])), (s.n, (dl.head_stride, st[1])),
                                 (count, (step * dl.token_stride, n * st[2])), (n, (dl.token_stride, st[2]))]
            self._add("decode", chunk, s, d_reg, d_off + slot * dl.token_stride, d_staged, pages,
                      before * block + tau * st[2], modes, hb)
        # ---- pack: P x D segments, classes (P slot, tokens, tokens of the D page's block)
        p_reg, p_off = self._layer_entries("prefill", g.index, layers, ppk == planes, planes, pl.kv_stride)
        p_off = p_off + s.p0 * pl.head_stride
        for slot, n, count, step, nj, pages, before, tau in tm.pack:
            st = compact(nj)
            kv_staging = st[0] if dpk == 2 else e_plane
            if ppk == planes:
                p_staged = p_base + lam * e_layer
            else:
                p_staged = p_base + np.repeat(lam * e_layer, planes) + np.tile(np.arange(planes), len(lam)) \
                    * kv_staging
            modes = [(ppk, (pl.kv_stride, kv_staging)), (s.n, (pl.head_stride, st[1])),
                     (count, (step * pl.token_stride, n * st[2])), (n, (pl.token_stride, st[2]))]
            self._add("prefill", chunk, s, p_reg, p_off + slot * pl.token_stride, p_staged, pages,
                      before * block + tau * st[2], modes, hb)

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
        l0, l1 = _overlap(secs[0][1], piece)  # one stage pair: every section of (p, d) has the same layers
        per_slot = [s.n * spec.sections[si].rows * spec.sections[si].unit_bytes for si, s in secs]
        e_layer = sum(per_slot) * len(g.p_slots)
        layers = range(l0, l1)
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
    operations: int  # pack and unpack (layer entry, pair) pairs: the torch operations on fresh pages


def _layout(pair: EnginePair, request: Request, staging_bytes: int
            ) -> tuple[_Planner, list[list[ChunkPiece]], list[dict[tuple[int, int], int]]]:
    check_int("staging_bytes", staging_bytes, minimum=0)  # 0: no staging (only a request moving nothing fits)
    pair.check_request(request)
    pl = _Planner(pair, request)
    chunks = _chunk_pieces(pl, staging_bytes)
    blocks: list[dict[tuple[int, int], int]] = []
    for pieces in chunks:
        per: dict[tuple[int, int], int] = {}
        for piece in pieces:
            g = pl.groups[piece.group]
            if g.attention:
                for s in g.pairs:
                    n = _pair_bytes(pl, g, piece, s)
                    if n:
                        per[(s.p, s.d)] = per.get((s.p, s.d), 0) + n
            else:
                for si in range(piece.section_start, piece.section_stop):
                    for s in g.sections[si]:
                        n = _pair_bytes(pl, g, piece, s, si)
                        if n:
                            per[(s.p, s.d)] = per.get((s.p, s.d), 0) + n
        blocks.append(per)
    return pl, chunks, blocks


def count_packed(pair: EnginePair, request: Request, staging_bytes: int = DEFAULT_STAGING_BYTES) -> PackedCount:
    """Chunks, wire rows, bytes and an operation count of the packed plan, without building steps."""
    pl, chunks, blocks = _layout(pair, request, staging_bytes)
    ops = 0
    for pieces in chunks:
        for piece in pieces:
            g = pl.groups[piece.group]
            slices = g.pairs if g.attention else tuple(s for si in range(piece.section_start, piece.section_stop)
                                                       for s in g.sections[si])
            for s in slices:
                l0, l1 = _overlap(s, piece)
                ops += 2 * max(0, l1 - l0)
    return PackedCount(len(chunks), sum(len(b) for b in blocks), sum(sum(b.values()) for b in blocks), ops)


def plan_packed(pair: EnginePair, request: Request, staging_bytes: int = DEFAULT_STAGING_BYTES) -> PackedParts:
    """Pack steps, wire rows, unpack steps, chunks, zeros and notes of ``request`` (every group
    packed); raises :class:`~kvgeom.errors.StagingCapacityError` when ``staging_bytes`` cannot hold
    the smallest piece."""
    pl, chunks, blocks = _layout(pair, request, staging_bytes)
    P, D = pair.prefill, pair.decode
    b = _Builder(pl)
    wire: list[tuple[int, int, int, int, int, int]] = []
    for c, (pieces, per) in enumerate(zip(chunks, blocks, strict=True)):
        pairs = sorted(per)  # (p, d)
        p_base: dict[tuple[int, int], int] = {}
        at_p: dict[int, int] = {}
        for key in sorted(pairs, key=lambda k: (k[0], k[1])):  # P slot: D ranks ascending
            p_base[key] = at_p.get(key[0], 0)
            at_p[key[0]] = p_base[key] + per[key]
        d_base: dict[tuple[int, int], int] = {}
        at_d: dict[int, int] = {}
        for key in sorted(pairs, key=lambda k: (k[1], k[0])):  # D slot: P ranks ascending
            d_base[key] = at_d.get(key[1], 0)
            at_d[key[1]] = d_base[key] + per[key]
        inside: dict[tuple[int, int], int] = {}  # bytes of the pair's block already laid out
        for piece in pieces:
            g = pl.groups[piece.group]
            if g.attention:
                for s in g.pairs:
                    n = _pair_bytes(pl, g, piece, s)
                    if not n:
                        continue
                    key = (s.p, s.d)
                    at = inside.get(key, 0)
                    b.attention(c, g, piece, s, p_base[key] + at, d_base[key] + at)
                    inside[key] = at + n
            else:
                for key in pairs:
                    n = sum(_pair_bytes(pl, g, piece, s, si) for si, s in _state_pair_sections(g, piece, *key))
                    if n:
                        at = inside.get(key, 0)
                        b.state(c, g, piece, key[0], key[1], p_base[key] + at, d_base[key] + at)
                        inside[key] = at + n
        for p, d in pairs:
            wire.append((c, p, p_base[(p, d)], d, d_base[(p, d)], per[(p, d)]))
    cols = np.array(sorted(wire, key=lambda w: (w[0], w[1], w[3])), np.int64).reshape(-1, 6)
    wire_rows = WireCopies(*(cols[:, i] for i in range(6)))
    chunk_list = tuple(Chunk(i, tuple(pieces)) for i, pieces in enumerate(chunks))
    zeros, notes = _zeros_and_notes(pair, request, pl.groups)
    used_p = np.zeros((len(chunks), P.num_ranks), np.int64)
    used_d = np.zeros((len(chunks), D.num_ranks), np.int64)
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
                                  f"through staging for {len({(s.p, s.d) for s in g.pairs})} (P rank, D rank) pairs, "
                                  "in D's page order"))
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


def packed_transfer_plan(pair: EnginePair, request: Request, staging_bytes: int,
                         notes: tuple[Note, ...]) -> TransferPlan:
    """The packed :class:`~kvgeom.values.plan.TransferPlan` of ``request``: :func:`plan_packed`'s
    parts after ``notes`` (the strategy note and whatever the caller decided)."""
    parts = plan_packed(pair, request, staging_bytes)
    return TransferPlan(
        prefill_tp=pair.prefill.tp,
        decode_tp=pair.decode.tp,
        copies=Copies.empty(),
        zeros=coalesce_zeros(parts.zeros),
        notes=notes + parts.notes,
        copies_before_coalescing=0,
        zeros_before_coalescing=len(parts.zeros),
        packs=parts.packs,
        unpacks=parts.unpacks,
        wire=parts.wire,
        chunks=parts.chunks,
        staging_bytes=parts.staging_bytes,
        prefill_ranks=pair.prefill.num_ranks,
        decode_ranks=pair.decode.num_ranks,
    )
