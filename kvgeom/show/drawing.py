"""Draw one request's transfer: which P rank and block fills each D token cell, what is zeroed.

matplotlib is optional (``kvgeom[notebook]``) and imported inside the functions only. The cells are
derived from the plan itself, by mapping every D coordinate back through the plan's rows::

    D coordinate (layer, token, plane, head)  --attention_address-->  D rank/region/byte  (final)
        zeros cover it?                     -> "zeroed"      (zeros run last)
        undo the rearranges, last first     -> the byte where the copy landed
        a copy row covers it?               -> P rank/region/byte -> P page -> P block (its
                                               position in P's listing)   -> coloured by P rank
        an unpack element covers it?        -> D slot byte of its chunk -> the wire row -> P slot
        (packed plans)                         byte -> the pack element -> P rank/region/byte -> as above
        nothing                             -> "untouched"   (e.g. the prefix D already holds)

    decode view (rank 0)      tokens ->   0 1 2 3 4 5 6 7 | 8 9 ...
      d0 full0 L0-1 K,V h0-1              P0 P0 P0 P0 P0' P0' ...      (' = next P block, lighter)
      d0 full0 L0-1 K,V h2-3              P1 P1 P1 P1 P1' P1' ... ///  (/// = zeroed)

The prefill view does the reverse: every coordinate a P rank holds, coloured by the D rank whose
copy reads it (dotted when several D ranks read it). State groups get one row per slot, layer and
section, with the rank's channel slice spread over the width. Rows that are identical across heads,
then planes, then layers are merged. Past ``max_cells`` tokens the axis is binned: a cell shows the
majority source of its tokens, lightened by the fraction zeroed (hatched when mostly zeroed).

Worked number: P TP2 -> D TP1, 4 heads, P K=4, D K=8, M=6 on one D block: D rank 0's heads 0-1
come from P rank 0 and heads 2-3 from P rank 1; tokens 0-3 from P block position 0, tokens 4-5
from position 1, tokens 6-7 zeroed: two rows of 8 cells (K and V merge, the one layer too).

On a topology (docs/design.md §11) every rank draws only what it holds: the layers of its stage
(rows merge per run of layers fed by the same P rank, so ``d3 attn L0-39`` and ``d3 attn L40-79``
show which P stage feeds which layers), its head group's heads and, with DCP, its own tokens
(the other token cells are left blank). Legend entries name each P rank's stage and TP rank.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import attrs
import numpy as np

from ..arith.tokens import locate
from ..errors import KvGeomError
from ..values.engine import EngineGeometry
from ..values.model import AttentionSpec, StateSpec
from ..values.notes import NoteKind
from ..values.plan import TransferPlan
from ..values.request import BlockList, Request, StateSlots

__all__ = ["CellMap", "Row", "DrawError", "transfer_cells", "draw", "save", "NOT_LISTED", "ZEROED", "UNTOUCHED", "SEVERAL",
           "SOURCE_STRIDE"]

UNTOUCHED = -1  # no copy lands here and nothing zeroes it (prefill view: no D rank reads it)
ZEROED = -2  # a zero row covers it
NOT_LISTED = -3  # outside the group's listed blocks on this side: not drawn
SOURCE_STRIDE = 1 << 20  # code = rank * SOURCE_STRIDE + position (block or slot index in the listing)
UNKNOWN_POSITION = SOURCE_STRIDE - 1  # read from a P block the request does not list
SEVERAL = 1  # prefill view: position 1 = read by several D ranks
_FULL_BUDGET = 1 << 22  # coordinates evaluated exactly; past this, each binned cell is sampled
_STATE_CELLS = 64  # most cells of a state row


class DrawError(KvGeomError):
    """A drawing argument is invalid (side, rank, file type)."""


@attrs.frozen(eq=False)
class Row:
    """One drawn row: its label, group, kind and per-cell ``codes`` and ``zero_fraction``."""

    label: str
    group: int
    kind: str  # "attention" or "state"
    rank: int
    codes: np.ndarray  # int64: a source code (>= 0) or UNTOUCHED / ZEROED / NOT_LISTED
    zero_fraction: np.ndarray  # float: share of the cell's tokens that are zeroed


@attrs.frozen(eq=False)
class CellMap:
    """Everything :func:`draw` renders: rows of cells over ``[token_lo, token_hi)``."""

    side: str
    rows: tuple[Row, ...]
    token_lo: int
    token_hi: int
    tokens_per_cell: int
    blocks: tuple[tuple[int, int, int, tuple[int, ...]], ...]  # per attention group: (group, first, B, ids)
    sampled: bool  # binned cells were estimated from a sample of their tokens
    title: str

    @property
    def cells(self) -> int:
        return -(-(self.token_hi - self.token_lo) // self.tokens_per_cell) if self.token_hi > self.token_lo else 0

    def sources(self) -> list[tuple[int, int]]:
        """Distinct (rank, position) of the source codes present, sorted."""
        codes = np.unique(np.concatenate([r.codes for r in self.rows])) if self.rows else np.zeros(0, np.int64)
        return [(int(c) // SOURCE_STRIDE, int(c) % SOURCE_STRIDE) for c in codes if c >= 0]

    def ranks(self) -> list[int]:
        """Distinct source ranks (P ranks in the decode view, reading D ranks in the prefill view)."""
        return sorted({r for r, _ in self.sources()})


# ---- interval lookups over plan rows -------------------------------------------------------------------


class _Intervals:
    """Byte ranges ``[start, start + n)`` of one (rank, region), looked up by address."""

    def __init__(self, start: np.ndarray, nbytes: np.ndarray, payload: Sequence[np.ndarray] = ()) -> None:
        order = np.argsort(start, kind="stable")
        self.start = start[order]
        self.end = self.start + nbytes[order]
        self.payload = [p[order] for p in payload]

    def find(self, addr: np.ndarray) -> np.ndarray:
        """Index of the row covering each address, -1 if none (the latest-starting candidate)."""
        if not len(self.start):
            return np.full(addr.shape, -1, np.int64)
        i = np.searchsorted(self.start, addr, side="right") - 1
        ok = (i >= 0) & (addr < self.end[np.maximum(i, 0)])
        return np.where(ok, i, -1)


def _by_key(columns: dict[str, np.ndarray], keys: tuple[str, ...], start: str, payload: tuple[str, ...]
            ) -> dict[tuple[int, ...], _Intervals]:
    out: dict[tuple[int, ...], _Intervals] = {}
    if not len(columns["nbytes"]):
        return out
    k = np.stack([columns[c] for c in keys], axis=1)
    uniq, inv = np.unique(k, axis=0, return_inverse=True)
    inv = inv.reshape(-1)
    for j, key in enumerate(uniq.tolist()):
        rows = np.flatnonzero(inv == j)
        out[tuple(key)] = _Intervals(columns[start][rows], columns["nbytes"][rows],
                                     [columns[p][rows] for p in payload])
    return out


def _step_intervals(steps: Sequence[Any], *, by_cache: bool, per_peer: bool = False
                    ) -> dict[tuple[int, ...], _Intervals]:
    """Every element of ``steps`` as an interval: keyed by (rank, cache region) with payload (chunk,
    cache start, staging start) when ``by_cache``, else by (rank, chunk) over the slot with payload
    (cache region, cache start, staging start). ``per_peer`` adds the other side's rank to the key:
    pack elements of different D ranks may read one P byte (replicated heads), one D rank's never."""
    parts: dict[tuple[int, ...], list[tuple[np.ndarray, ...]]] = {}
    for st in steps:
        for lam in range(len(st.regions)):
            cache = st.cache_offsets(lam).ravel()
            staging = st.staging_offsets(lam).ravel()
            n = np.full(cache.shape, st.unit_bytes, np.int64)
            region = int(st.regions[lam])
            if by_cache:
                key: tuple[int, ...] = (st.rank, region, st.d_rank if st.side == "prefill" else st.p_rank) if per_peer else \
                    (st.rank, region)
                parts.setdefault(key, []).append((cache, n, np.full(cache.shape, st.chunk), cache, staging))
            else:
                parts.setdefault((st.rank, st.chunk), []).append((staging, n, np.full(cache.shape, region), cache,
                                                                   staging))
    out: dict[tuple[int, ...], _Intervals] = {}
    for k, chunks in parts.items():
        start, n, a, b, c = (np.concatenate([x[i] for x in chunks]) for i in range(5))
        out[k] = _Intervals(start, n, [a, b, c])
    return out


class _Resolver:
    """Maps final D addresses to their source (decode view) or P addresses to readers (prefill view)."""

    def __init__(self, plan: TransferPlan, prefill: EngineGeometry, decode: EngineGeometry) -> None:
        c, z = plan.copies, plan.zeros
        cols = {n: getattr(c, n) for n in ("p_rank", "p_region", "p_offset", "d_rank", "d_region", "d_offset",
                                            "nbytes")}
        self.copies_d = _by_key(cols, ("d_rank", "d_region"), "d_offset", ("p_rank", "p_region", "p_offset",
                                                                           "d_offset"))
        self.copies_p = _by_key(cols, ("p_rank", "p_region", "d_rank"), "p_offset", ())
        self.zeros = _by_key({"d_rank": z.d_rank, "d_region": z.d_region, "d_offset": z.d_offset,
                              "nbytes": z.nbytes}, ("d_rank", "d_region"), "d_offset", ())
        self.rearranges = plan.rearranges
        self.prefill, self.decode = prefill, decode
        self.decode_ranks = plan.decode_ranks
        self._inverse: dict[int, np.ndarray] = {}
        # packed plans: every step element as an interval (StagingStep.cache_offsets / staging_offsets),
        # every wire row as an interval of its slot
        w = plan.wire
        wcols = {"chunk": w.chunk, "p_rank": w.p_rank, "p_offset": w.p_offset, "d_rank": w.d_rank,
                 "d_offset": w.d_offset, "nbytes": w.nbytes}
        self.wire_d = _by_key(wcols, ("d_rank", "chunk"), "d_offset", ("p_rank", "p_offset", "d_offset"))
        self.wire_p = _by_key(wcols, ("p_rank", "chunk"), "p_offset", ("d_rank",))
        self.unpack_cache = _step_intervals(plan.unpacks, by_cache=True)  # (d_rank, region) -> chunk, staging
        self.pack_staging = _step_intervals(plan.packs, by_cache=False)  # (p_rank, chunk) -> region, cache
        self.pack_cache = _step_intervals(plan.packs, by_cache=True, per_peer=True)  # (p_rank, region, d_rank) -> ...

    def _inverse_map(self, k: int) -> np.ndarray:
        """In-page byte -> the in-page byte it was read from, for rearrange ``k``."""
        if k not in self._inverse:
            r = self.rearranges[k]
            inv = np.arange(r.page_bytes, dtype=np.int64)
            src, dst = r.src_offsets(), r.dst_offsets()
            u = np.arange(r.unit_bytes)
            d_all = (dst[:, None] + u).ravel()
            s_all = (src[:, None] + u).ravel()
            keep = (d_all >= 0) & (d_all < r.page_bytes)
            inv[d_all[keep]] = s_all[keep]
            self._inverse[k] = inv
        return self._inverse[k]

    def decode_sources(self, rank: int, region: int, addr: np.ndarray, p_listing: Any,
                       p_kind: str) -> tuple[np.ndarray, np.ndarray]:
        """(code per address, zeroed mask) for final D addresses of one rank and region."""
        zeroed = np.zeros(addr.shape, bool)
        zi = self.zeros.get((rank, region))
        if zi is not None:
            zeroed = zi.find(addr) >= 0
        pre = addr.copy()
        for k in range(len(self.rearranges) - 1, -1, -1):
            r = self.rearranges[k]
            if r.d_rank != rank or r.d_region != region:
                continue
            page = pre // r.page_bytes
            hit = np.isin(page, np.asarray(r.pages, np.int64))
            if hit.any():
                inv = self._inverse_map(k)
                pre = np.where(hit, page * r.page_bytes + inv[np.where(hit, pre % r.page_bytes, 0)], pre)
        codes = np.full(addr.shape, UNTOUCHED, np.int64)
        ci = self.copies_d.get((rank, region))
        if ci is not None:
            i = ci.find(pre)
            got = i >= 0
            j = np.maximum(i, 0)
            p_rank, p_region, p_offset, d_offset = (x[j] for x in ci.payload)
            p_addr = p_offset + (pre - d_offset)
            pos = self._positions(p_region, p_addr, p_listing, p_kind)
            codes = np.where(got, p_rank * SOURCE_STRIDE + pos, codes)
        if self.unpack_cache:
            codes = np.where(codes == UNTOUCHED, self._packed_source(rank, region, pre, p_listing, p_kind), codes)
        codes = np.where(zeroed, ZEROED, codes)
        return codes, zeroed

    def _packed_source(self, rank: int, region: int, addr: np.ndarray, p_listing: Any, p_kind: str) -> np.ndarray:
        """Codes of D addresses an unpack writes: back through the D slot, the wire row and the pack."""
        codes = np.full(addr.shape, UNTOUCHED, np.int64)
        iv = self.unpack_cache.get((rank, region))
        if iv is None:
            return codes
        i = iv.find(addr)
        got = i >= 0
        j = np.maximum(i, 0)
        chunk, elem_cache, elem_staging = (x[j] for x in iv.payload)
        d_slot = elem_staging + (addr - elem_cache)
        for c in np.unique(chunk[got]).tolist():
            sel = got & (chunk == c)
            wv = self.wire_d.get((rank, c))
            if wv is None:
                continue
            k = wv.find(d_slot)
            sel &= k >= 0
            kk = np.maximum(k, 0)
            p_rank, p_off, d_off = (x[kk] for x in wv.payload)
            p_slot = p_off + (d_slot - d_off)
            for p in np.unique(p_rank[sel]).tolist():
                mine = sel & (p_rank == p)
                pv = self.pack_staging.get((p, c))
                if pv is None:
                    continue
                m = pv.find(p_slot)
                mine &= m >= 0
                mm = np.maximum(m, 0)
                p_region, cache0, staging0 = (x[mm] for x in pv.payload)
                p_addr = cache0 + (p_slot - staging0)
                pos = self._positions(p_region, p_addr, p_listing, p_kind)
                codes = np.where(mine, p * SOURCE_STRIDE + pos, codes)
        return codes

    def _positions(self, p_region: np.ndarray, p_addr: np.ndarray, listing: Any, kind: str) -> np.ndarray:
        """Index of the P block (or slot) holding each P address in P's listing (UNKNOWN if unlisted)."""
        P = self.prefill
        page_bytes = np.array([r.page_bytes for r in P.regions], np.int64)
        per = page_bytes[p_region] * (P.blocks_per_logical if kind == "state" else 1)
        unit = p_addr // per
        block = unit if kind == "state" else unit // P.blocks_per_logical
        ids = np.asarray(listing.slot_ids if kind == "state" else listing.block_ids, np.int64)
        if not len(ids):
            return np.full(block.shape, UNKNOWN_POSITION, np.int64)
        table = np.full(int(max(ids.max(), block.max(initial=0))) + 1, UNKNOWN_POSITION, np.int64)
        table[ids] = np.arange(len(ids))
        return table[np.clip(block, 0, len(table) - 1)]

    def prefill_readers(self, rank: int, region: int, addr: np.ndarray) -> np.ndarray:
        """Code per P address: lowest reading D rank, position SEVERAL when more than one reads it."""
        count = np.zeros(addr.shape, np.int64)
        lowest = np.full(addr.shape, -1, np.int64)
        for d in range(self.decode_ranks):
            iv = self.copies_p.get((rank, region, d))
            if iv is None:
                continue
            hit = iv.find(addr) >= 0
            count += hit
            lowest = np.where(hit & (lowest < 0), d, lowest)
        if self.pack_cache:
            for d, hit in self._packed_readers(rank, region, addr):
                count += hit
                lowest = np.where(hit & ((lowest < 0) | (lowest > d)), d, lowest)
        return np.where(count == 0, UNTOUCHED, lowest * SOURCE_STRIDE + np.where(count > 1, SEVERAL, 0))

    def _packed_readers(self, rank: int, region: int, addr: np.ndarray) -> list[tuple[int, np.ndarray]]:
        """(D rank, mask) for every D rank whose wire rows carry P addresses a pack gathers for it."""
        out: list[tuple[int, np.ndarray]] = []
        for d in range(self.decode_ranks):
            iv = self.pack_cache.get((rank, region, d))
            if iv is None:
                continue
            i = iv.find(addr)
            got = i >= 0
            j = np.maximum(i, 0)
            chunk, elem_cache, elem_staging = (x[j] for x in iv.payload)
            p_slot = elem_staging + (addr - elem_cache)
            hit = np.zeros(addr.shape, bool)
            for c in np.unique(chunk[got]).tolist():
                wv = self.wire_p.get((rank, c))
                if wv is None:
                    continue
                k = wv.find(p_slot)
                hit |= got & (chunk == c) & (k >= 0) & (wv.payload[0][np.maximum(k, 0)] == d)
            if hit.any():
                out.append((d, hit))
        return out


# ---- cells ----------------------------------------------------------------------------------------------


def _sample_tokens(lo: int, hi: int, max_cells: int, rows: int) -> tuple[int, np.ndarray, bool]:
    """(tokens per cell, sampled tokens as [cells, k], sampled?)."""
    span = hi - lo
    if span <= 0:
        return 1, np.zeros((0, 1), np.int64), False
    tpc = max(1, -(-span // max_cells))
    cells = -(-span // tpc)
    if rows * span <= _FULL_BUDGET or tpc == 1:
        k, sampled = tpc, False
    else:
        k, sampled = max(2, min(tpc, _FULL_BUDGET // max(1, rows * cells))), True
    offs = np.unique(np.linspace(0, tpc - 1, k).round().astype(np.int64)) if sampled else np.arange(tpc)
    tok = lo + np.arange(cells)[:, None] * tpc + offs[None, :]
    return tpc, np.where(tok < hi, tok, -1), sampled


def _reduce(codes: np.ndarray, zeroed: np.ndarray, valid: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per cell (last axis = the cell's sampled tokens): majority source, else ZEROED/UNTOUCHED/NOT_LISTED,
    and the zeroed fraction of its listed tokens."""
    listed = valid.sum(-1)
    zf = np.where(listed > 0, (zeroed & valid).sum(-1) / np.maximum(listed, 1), 0.0)
    src = (codes >= 0) & valid
    if codes.shape[-1] == 1:
        out = np.where(valid[..., 0], codes[..., 0], NOT_LISTED)
        return out, zf
    # the mode of each cell's source codes: sort, then the longest run of equal codes
    k = codes.shape[-1]
    s = np.sort(np.where(src, codes, -1), axis=-1)
    change = np.ones(s.shape, bool)
    change[..., 1:] = s[..., 1:] != s[..., :-1]
    idx = np.arange(k)
    run_start = np.maximum.accumulate(np.where(change, idx, 0), axis=-1)
    run = np.where(s >= 0, idx - run_start + 1, 0)
    best = np.take_along_axis(s, run.argmax(-1)[..., None], -1)[..., 0]
    any_zero = (zeroed & valid).any(-1)
    out = np.where(src.any(-1), best, np.where(any_zero, ZEROED, np.where(listed > 0, UNTOUCHED, NOT_LISTED)))
    return out, zf


def _span(ids: Sequence[int], first: int, B: int) -> tuple[int, int]:
    return first, first + len(ids) * B


def _locate(engine: EngineGeometry, listing: BlockList, tokens: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(valid, kernel page, slot) of global tokens on a side's listing."""
    B, K, ppl = engine.logical_block_tokens, engine.kernel_block_tokens, engine.blocks_per_logical
    lo, hi = _span(listing.block_ids, listing.first_token, B)
    valid = (tokens >= lo) & (tokens < hi)
    if not listing.block_ids:
        zero = np.zeros_like(tokens)
        return valid, zero, zero
    page, slot = locate(np.asarray(listing.block_ids, np.int64), listing.first_token, K, ppl,
                        np.where(valid, tokens, listing.first_token), engine.topology.dcp, engine.topology.interleave)
    return valid, page, slot


def _ranges(values: Sequence[int]) -> str:
    vals = list(values)
    if not vals:
        return ""
    parts, start, prev = [], vals[0], vals[0]
    for v in vals[1:] + [None]:  # type: ignore[list-item]
        if v is not None and v == prev + 1:
            prev = v
            continue
        parts.append(f"{start}" if start == prev else f"{start}-{prev}")
        if v is not None:
            start = prev = v
    return ",".join(parts)


def _same(a: list[tuple[Any, np.ndarray, np.ndarray]], b: list[tuple[Any, np.ndarray, np.ndarray]]) -> bool:
    return len(a) == len(b) and all(x[0] == y[0] and np.array_equal(x[1], y[1]) and np.allclose(x[2], y[2])
                                    for x, y in zip(a, b))


def _merge_runs(items: list[tuple[int, np.ndarray, np.ndarray]]) -> list[tuple[tuple[int, ...], np.ndarray, np.ndarray]]:
    """Consecutive items with equal cells merge: [(indices, codes, zf)]."""
    out: list[tuple[tuple[int, ...], np.ndarray, np.ndarray]] = []
    for i, c, z in items:
        if out and np.array_equal(out[-1][1], c) and np.allclose(out[-1][2], z):
            out[-1] = (out[-1][0] + (i,), out[-1][1], out[-1][2])
        else:
            out.append(((i,), c, z))
    return out


def _merge_layers(per_layer: list[list[tuple[Any, np.ndarray, np.ndarray]]]) -> list[tuple[list[int], list[Any]]]:
    out: list[tuple[list[int], list[Any]]] = []
    for li, struct in enumerate(per_layer):
        if out and _same(out[-1][1], struct):
            out[-1][0].append(li)
        else:
            out.append(([li], struct))
    return out


def transfer_cells(
    plan: TransferPlan,
    pair: Any,
    request: Request,
    *,
    side: str = "decode",
    rank: int | None = None,
    max_cells: int = 256,
) -> CellMap:
    """The cells :func:`draw` renders (see the module docstring), for tests and custom plots."""
    if side not in ("decode", "prefill"):
        raise DrawError("side", f"unknown side {side!r}", actual=side, expected=["decode", "prefill"])
    P, D = pair.prefill, pair.decode
    engine = D if side == "decode" else P
    if rank is not None and not (isinstance(rank, int) and 0 <= rank < engine.num_ranks):
        what = f"tp={engine.tp}" if engine.topology.trivial else f"{engine.num_ranks} ranks"
        raise DrawError("rank", f"rank {rank!r} is outside the {side} engine's {what}", actual=rank,
                        expected=f"0 <= rank < {engine.num_ranks} or None (all ranks)")
    if not isinstance(max_cells, int) or max_cells < 1:
        raise DrawError("max_cells", f"must be a positive int, got {max_cells!r}", actual=max_cells, expected=">= 1")
    res = _Resolver(plan, P, D)
    ranks = range(engine.num_ranks) if rank is None else (rank,)
    model = engine.model
    letter = "d" if side == "decode" else "p"

    spans = []
    for g, spec in enumerate(model.groups):
        listing = getattr(request.groups[g], side)
        if isinstance(spec, AttentionSpec) and isinstance(listing, BlockList):
            spans.append(_span(listing.block_ids, listing.first_token, engine.logical_block_tokens))
    lo = min((a for a, b in spans if b > a), default=0)
    hi = max((b for a, b in spans if b > a), default=0)
    est_rows = sum(spec.num_layers * spec.planes * engine.local_heads(g)
                   for g, spec in enumerate(model.groups) if isinstance(spec, AttentionSpec)) * len(ranks)
    tpc, tok, sampled = _sample_tokens(lo, hi, max_cells, max(1, est_rows))
    rows: list[Row] = []
    blocks: list[tuple[int, int, int, tuple[int, ...]]] = []
    for r in ranks:
        for g, spec in enumerate(model.groups):
            gr = request.groups[g]
            listing = getattr(gr, side)
            if isinstance(spec, AttentionSpec) and isinstance(listing, BlockList):
                if r == ranks[0]:
                    blocks.append((g, listing.first_token, engine.logical_block_tokens, listing.block_ids))
                rows.extend(_attention_rows(res, side, engine, g, spec, r, listing, gr.prefill, tok, letter))
            elif isinstance(spec, StateSpec) and isinstance(listing, StateSlots):
                rows.extend(_state_rows(res, side, engine, g, spec, r, listing, gr.prefill, letter))
    strategy = next((n.text.split(" ", 1)[-1] for n in plan.notes if n.kind is NoteKind.STRATEGY), "?")
    title = (f"{side} view, {'all ranks' if rank is None else f'{letter.upper()} rank {rank}'}: "
             f"P {P.topology.describe(P.tp)} K={P.kernel_block_tokens} ppl={P.blocks_per_logical} -> "
             f"D {D.topology.describe(D.tp)} K={D.kernel_block_tokens} ppl={D.blocks_per_logical}; "
             f"M={request.computed_tokens} S={request.prefix_hit_tokens}; strategy {strategy}")
    if tpc > 1:
        title += f"; {tpc} tokens per cell" + (" (sampled)" if sampled else "")
    return CellMap(side, tuple(rows), lo, hi, tpc, tuple(blocks), sampled, title)


def _attention_rows(res: _Resolver, side: str, engine: EngineGeometry, g: int, spec: AttentionSpec, rank: int,
                    listing: BlockList, p_listing: Any, tok: np.ndarray, letter: str) -> list[Row]:
    holds = engine.holds(rank)[spec.name]
    held, layers, shard = holds["heads"], holds["layers"], holds["tokens"]
    heads = np.arange(held.size, dtype=np.int64)
    flat = tok.ravel()
    valid, page, slot = _locate(engine, listing, np.where(flat >= 0, flat, 0))
    valid &= flat >= 0
    if shard.size > 1:  # a DCP rank draws only its own tokens
        valid &= (flat // shard.interleave) % shard.size == shard.rank
    per_layer: list[list[tuple[Any, np.ndarray, np.ndarray]]] = []
    for layer in range(layers.start, layers.stop):
        planes: list[list[tuple[tuple[int, ...], np.ndarray, np.ndarray]]] = []
        for plane in range(spec.planes):
            region, starts = engine.attention_address(g, layer, plane, page[:, None], slot[:, None], heads[None, :])
            if side == "decode":
                codes, zeroed = res.decode_sources(rank, region, starts, p_listing, "attention")
            else:
                codes = res.prefill_readers(rank, region, starts)
                zeroed = np.zeros(codes.shape, bool)
            shape = tok.shape + (held.size,)
            c3 = np.where(valid[:, None], codes, NOT_LISTED).reshape(shape)
            z3 = (zeroed & valid[:, None]).reshape(shape)
            v3 = np.broadcast_to(valid[:, None], codes.shape).reshape(shape)
            cells, zf = _reduce(np.moveaxis(c3, 2, 0), np.moveaxis(z3, 2, 0), np.moveaxis(v3, 2, 0))
            planes.append(_merge_runs([(h, cells[h], zf[h]) for h in range(held.size)]))
        if spec.planes == 2 and _same(planes[0], planes[1]):  # type: ignore[arg-type]
            per_layer.append([(("K,V", idx), c, z) for idx, c, z in planes[0]])
        else:
            names = ("latent",) if spec.planes == 1 else ("K", "V")
            per_layer.append([((names[p], idx), c, z) for p, runs in enumerate(planes) for idx, c, z in runs])
    out = []
    who = _rank_label(engine, letter, rank)
    token_text = "" if shard.size == 1 else f" tokens {shard}"
    for merged, struct in _merge_layers(per_layer):
        for (pname, idx), c, z in struct:
            head_text = "" if spec.kind.value == "mla" else " h" + _ranges([held.start + i for i in idx])
            out.append(Row(f"{who} {spec.name} L{_ranges([layers.start + i for i in merged])} {pname}{head_text}"
                           f"{token_text}", g, "attention", rank, c, z))
    return out


def _rank_label(engine: EngineGeometry, letter: str, rank: int) -> str:
    """``d3``; ``p5[s1]`` on a multi-stage engine (the rank's pipeline stage)."""
    if engine.topology.pp == 1:
        return f"{letter}{rank}"
    return f"{letter}{rank}[s{engine.coords(rank).stage}]"


def _state_rows(res: _Resolver, side: str, engine: EngineGeometry, g: int, spec: StateSpec, rank: int,
                listing: StateSlots, p_listing: Any, letter: str) -> list[Row]:
    out = []
    holds = engine.holds(rank)[spec.name]
    layers = holds["layers"]
    who = _rank_label(engine, letter, rank)
    for slot_id, tokens in zip(listing.slot_ids, listing.tokens):
        for si, sec in enumerate(spec.sections):
            held = holds[sec.name]
            n = held.size
            per = max(1, -(-n // _STATE_CELLS))
            cells = -(-n // per)
            ch = np.arange(cells)[:, None] * per + np.arange(per)[None, :]
            valid = ch < n
            per_layer: list[list[tuple[Any, np.ndarray, np.ndarray]]] = []
            for layer in range(layers.start, layers.stop):
                region, starts = engine.state_address(g, layer, si, slot_id, np.where(valid, ch, 0), 0)
                if side == "decode":
                    codes, zeroed = res.decode_sources(rank, region, starts, p_listing, "state")
                else:
                    codes = res.prefill_readers(rank, region, starts)
                    zeroed = np.zeros(codes.shape, bool)
                c, z = _reduce(np.where(valid, codes, NOT_LISTED), zeroed & valid, valid)
                per_layer.append([(None, c, z)])
            for merged, struct in _merge_layers(per_layer):
                _, c, z = struct[0]
                out.append(Row(f"{who} {spec.name} L{_ranges([layers.start + i for i in merged])} {sec.name} slot "
                               f"{slot_id} ({tokens} tok, {n} ch)", g, "state", rank, c, z))
    return out


# ---- drawing --------------------------------------------------------------------------------------------


def _colour(rank: int, position: int, shade_blocks: bool) -> tuple[float, float, float]:
    """tab10 by rank; every other source block a lighter shade (when blocks are wider than cells)."""
    from matplotlib import colormaps

    base = colormaps["tab10"](rank % 10)[:3]
    light = 0.45 if (shade_blocks and position % 2 == 1 and position != UNKNOWN_POSITION) else 0.0
    return (base[0] + (1 - base[0]) * light, base[1] + (1 - base[1]) * light, base[2] + (1 - base[2]) * light)


def _lighten(c: tuple[float, float, float], f: float) -> tuple[float, float, float]:
    return (c[0] + (1 - c[0]) * f, c[1] + (1 - c[1]) * f, c[2] + (1 - c[2]) * f)


def draw(
    plan: TransferPlan,
    pair: Any,
    request: Request,
    *,
    rank: int | None = None,
    side: str = "decode",
    max_cells: int = 256,
    max_rows: int = 64,
    ax: Any = None,
) -> Any:
    """One picture of ``request``'s transfer under ``plan``; returns the matplotlib ``Figure``.

    ``side="decode"``: D token cells per layer and head group, coloured by source P rank (a lighter
    shade for every other P block), zeroed cells hatched, untouched cells blank with an outline.
    ``side="prefill"``: P cells coloured by the D rank reading them. ``rank``: one rank of that
    side, or None for all. Past ``max_cells`` tokens cells are binned; past ``max_rows`` rows the
    rest are left out (the title says how many). ``ax``: draw into an existing Axes.
    """
    from matplotlib.collections import PatchCollection
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch, Rectangle

    cm = transfer_cells(plan, pair, request, side=side, rank=rank, max_cells=max_cells)
    if not isinstance(max_rows, int) or max_rows < 1:
        raise DrawError("max_rows", f"must be a positive int, got {max_rows!r}", actual=max_rows, expected=">= 1")
    rows = list(cm.rows[:max_rows])
    hidden = len(cm.rows) - len(rows)
    x0 = float(cm.token_lo)
    width = float(cm.cells * cm.tokens_per_cell) if cm.cells else 1.0
    if ax is None:
        fig = Figure(figsize=(12.0, max(2.2, 1.2 + 0.24 * (len(rows) + len(cm.blocks)))), layout="constrained")
        ax = fig.add_subplot()
    else:
        fig = ax.figure

    fills: list[Any] = []
    fill_colours: list[Any] = []
    zero_patches: list[Any] = []
    several: list[Any] = []
    blank: list[Any] = []
    labels: list[str] = []
    y = 0
    ticks: list[float] = []
    block_label_y: dict[int, float] = {}
    shade_blocks = side == "decode" and 2 * cm.tokens_per_cell <= pair.prefill.logical_block_tokens
    state_band = False
    group_end: dict[int, float] = {}
    for row in rows:
        if row.kind == "attention" and row.group not in block_label_y:
            block_label_y[row.group] = y
            y += 1  # a band above the group's rows for its block ids
        if row.kind == "attention":
            group_end[row.group] = y + 1
        if row.kind == "state" and not state_band:
            state_band = True
            ax.axhline(y, color="0.5", linewidth=0.6)
            ax.text(x0 + width / 2, y + 0.5, "state rows: the rank's channels of the section, left to right",
                    ha="center", va="center", fontsize=7, color="0.3")
            y += 1
        cw = cm.tokens_per_cell if row.kind == "attention" else width / max(1, len(row.codes))
        codes, zf = row.codes, row.zero_fraction
        i = 0
        while i < len(codes):
            j = i + 1
            while j < len(codes) and codes[j] == codes[i] and round(zf[j] * 4) == round(zf[i] * 4):
                j += 1
            code = int(codes[i])
            rect = Rectangle((x0 + i * cw, y + 0.1), (j - i) * cw, 0.8)
            if code >= 0:
                r, pos = divmod(code, SOURCE_STRIDE)
                colour = _colour(r, pos, shade_blocks)
                if zf[i] >= 0.5:
                    zero_patches.append(rect)
                else:
                    fills.append(rect)
                    fill_colours.append(_lighten(colour, 0.6 * float(zf[i])))
                if side == "prefill" and pos == SEVERAL:
                    several.append(Rectangle((x0 + i * cw, y + 0.1), (j - i) * cw, 0.8))
            elif code == ZEROED:
                zero_patches.append(rect)
            elif code == UNTOUCHED:
                blank.append(rect)
            i = j
        ticks.append(y + 0.5)
        labels.append(row.label)
        y += 1
    if fills:
        ax.add_collection(PatchCollection(fills, facecolors=fill_colours, edgecolors="none", linewidths=0))
    if zero_patches:
        ax.add_collection(PatchCollection(zero_patches, facecolors="white", edgecolors="0.35", hatch="////",
                                          linewidths=0.3))
    if several:
        ax.add_collection(PatchCollection(several, facecolors="none", edgecolors="black", hatch="..",
                                          linewidths=0))
    if blank:
        ax.add_collection(PatchCollection(blank, facecolors="white", edgecolors="0.7", linewidths=0.5))
    # block boundaries and ids
    for g, first, B, ids in cm.blocks:
        if g not in block_label_y:
            continue
        yb = block_label_y[g]
        name = pair.decode.model.groups[g].name if side == "decode" else pair.prefill.model.groups[g].name
        ax.text(x0 - 0.005 * width, yb + 0.5, f"{name} blocks", ha="right", va="center", fontsize=7, color="0.3")
        if len(ids) <= 64:
            for k, b in enumerate(ids):
                s = first + k * B
                ax.vlines(s, yb, group_end.get(g, yb + 1), color="0.6", linewidth=0.4, zorder=0)
                if len(ids) <= 40:
                    ax.text(s + B / 2, yb + 0.5, str(b), ha="center", va="center", fontsize=7, color="0.3")
    ax.set_xlim(x0, x0 + width)
    ax.set_ylim(max(y, 1), 0)
    ax.set_yticks(ticks)
    ax.set_yticklabels(labels, fontsize=7)
    ax.set_xlabel("token" + (f" ({cm.tokens_per_cell} per cell)" if cm.tokens_per_cell > 1 else ""))
    ax.set_title(cm.title + (f"; {hidden} more rows not shown" if hidden else ""), fontsize=8)
    # legend
    handles: list[Any] = []
    who = "P" if side == "decode" else "D"
    source_engine = pair.prefill if side == "decode" else pair.decode
    for r in sorted({int(c) // SOURCE_STRIDE for row in rows for c in row.codes if c >= 0}):
        where = ""
        if not source_engine.topology.trivial and 0 <= r < source_engine.num_ranks:
            c = source_engine.coords(r)
            where = f" (stage {c.stage}, tp {c.tp_rank}" + (f", replica {c.replica}" if c.replica else "") + ")"
        handles.append(Patch(facecolor=_colour(r, 0, False), label=f"{who} rank {r}{where}"))
    if side == "decode":
        handles.append(Patch(facecolor="white", edgecolor="0.35", hatch="////", label="zeroed"))
        handles.append(Patch(facecolor="white", edgecolor="0.7", label="untouched"))
    else:
        if several:
            handles.append(Patch(facecolor="white", edgecolor="black", hatch="..", label="read by several D ranks"))
        handles.append(Patch(facecolor="white", edgecolor="0.7", label="not read"))
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=7, frameon=False)
    return fig


def save(fig: Any, path: str | Path) -> Path:
    """Write ``fig`` to ``path``; the suffix (``.svg`` or ``.png``) picks the format."""
    p = Path(path)
    fmt = p.suffix.lower().lstrip(".")
    if fmt not in ("svg", "png"):
        raise DrawError("path", f"cannot tell the format of {str(p)!r}", actual=p.suffix,
                        expected=[".svg", ".png"], fix="name the file *.svg or *.png")
    fig.savefig(p, format=fmt, bbox_inches="tight")
    return p
