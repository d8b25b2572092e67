"""Where a drawn coordinate's bytes come from, read from the plan itself (docs/design.md §4.1, §12.1):
:class:`_Resolver` maps final D addresses back through the zeros, the rearranges (last first), the
copy rows and a packed plan's unpack, wire and pack steps to a P rank and byte (the decode view),
or P addresses to the D ranks whose copies read them (the prefill view), by interval lookups over
the plan's rows per (rank, region); with the cell codes (:data:`UNTOUCHED`, :data:`ZEROED`,
``rank * SOURCE_STRIDE + position``) every view draws.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from ..errors import KvGeomError
from ..values.engine import EngineGeometry
from ..values.plan import TransferPlan

UNTOUCHED = -1  # no copy lands here and nothing zeroes it (prefill view: no D rank reads it)
ZEROED = -2  # a zero row covers it
SOURCE_STRIDE = 1 << 20  # code = rank * SOURCE_STRIDE + position (block or slot index in the listing)
UNKNOWN_POSITION = SOURCE_STRIDE - 1  # read from a P block the request does not list
SEVERAL = 1  # prefill view: position 1 = read by several D ranks


class DrawError(KvGeomError):
    """A drawing argument is invalid (side, rank, file type)."""


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

