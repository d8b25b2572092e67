"""Row assembly of the compiled pair: one request's units (D pages or slot pairs) of every group
expanded into the plan's copy and zero rows, stream after stream in the order coalescing sorts
into, as outer-sum blocks (:class:`~kvgeom.values.blocks.CopyBlock`) or written out as columns
(docs/design.md §13, §4.3). :class:`_Assembly` is how the streams of all groups interleave (built once
per combination of variants); :func:`_blocks` merges the streams groups share (by sorting or by
insertion, on sizes: ``MERGE_ROWS``); :func:`_materialize` writes the columns.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import attrs
import numpy as np

from ..errors import InternalError
from ..values.blocks import CopyBlock
from .compile_step import _Source
from .pieces import FamilyRows, FlatRows, Pieces, Rep, StreamTable, Units, flat_rows, stream_rows

MERGE_ROWS = 65536  # flat rows of several groups up to this many are sorted together into one block


# ---- one request's work per group, and the rows it gives -------------------------------------------------


@attrs.frozen(eq=False)
class _Work:
    """One group's units for one request under one source: the units sorted by id and the windows
    their kinds index (``keys[k]`` names window ``k`` in the source's caches)."""

    src: _Source
    units: Units
    windows: list[Pieces]
    keys: tuple[Any, ...]


def _family_rows(work: _Work, only: set[int] | None = None) -> list[FamilyRows | None]:
    src = work.src
    used = np.unique(work.units.kind)
    keys = tuple(work.keys[int(k)] for k in used)
    out: list[FamilyRows | None] = []
    for f, fam in enumerate(src.families):
        if only is not None and f not in only:
            out.append(None)
            continue
        reps: list[Rep] = []
        for k in range(len(work.windows)):
            rep = src.rep(f, work.keys[k], work.windows[k])
            if rep is None:
                break
            reps.append(rep)
        else:
            merge = src.merges(f, keys, [reps[int(k)] for k in used])
            d, p, n = stream_rows(work.units, reps, fam.unit_d, fam.unit_p, src.two_sided, merge)
            out.append(FamilyRows(fam, d, p, n))
            continue
        split = [stream_rows(work.units, [w.of(s) for w in work.windows], fam.unit_d, fam.unit_p, src.two_sided)
                 for s in fam.streams.tolist()]
        z = np.zeros(0, np.int64)
        out.append(FamilyRows(fam, z, z, z, tuple(split)))
    return out


class _Assembly:
    """How the streams of every group interleave in the plan's order (one table of global keys),
    and which groups are planned flat (every stream in one pass) or by families.

    ``items``: ``("run", group, family, i0, i1, first global stream)`` (consecutive global streams
    fed by one family's consecutive streams, written as one 2-D block) or ``("flat", group, gs0,
    gs1)`` (global streams of one flat group, its rows as they come) or ``("flat", "mixed", gs0,
    gs1)`` (streams several groups share a region for: their rows sorted by D offset and merged per
    request).
    """

    def __init__(self, sources: Sequence[_Source | None], widths: Sequence[int], flat: Sequence[bool]) -> None:
        used = [(g, s) for g, s in enumerate(sources) if s is not None and len(s.table)]
        keys = np.concatenate([s.table.keys for _, s in used]) if used else np.zeros((0, len(widths)), np.int64)
        self.table = StreamTable.of(keys, widths)
        self.to_global: dict[int, np.ndarray] = {g: self.table.index(s.table.keys) for g, s in used}
        owners: list[list[int]] = [[] for _ in range(len(self.table))]
        for g, _ in used:
            for gs in self.to_global[g].tolist():
                owners[gs].append(g)
        self.flat = {g: bool(flat[g]) for g, _ in used}
        self.items: list[tuple[Any, ...]] = []
        local = {g: np.empty(len(self.table), np.int64) for g, _ in used}
        for g, _ in used:
            local[g][self.to_global[g]] = np.arange(len(self.to_global[g]))
        for gs, own in enumerate(owners):
            if not own:
                continue
            last = self.items[-1] if self.items else None
            if len(own) == 1 and not self.flat[own[0]]:  # one family's rows, written in place
                g = own[0]
                src = sources[g]
                if src is None:
                    raise InternalError("an owner without a source")
                s = int(local[g][gs])
                f, i = int(src.family_of[s]), int(src.index_in_family[s])
                if f < 0:
                    continue
                if last is not None and last[0] == "run" and last[1:3] == (g, f) and last[4] == i:
                    self.items[-1] = ("run", g, f, last[3], i + 1, last[5])
                else:
                    self.items.append(("run", g, f, i, i + 1, gs))
            else:  # flat: one flat group's rows, or a stream several groups share ("mixed")
                key: Any = own[0] if len(own) == 1 else "mixed"
                if last is not None and last[0] == "flat" and last[1] == key and last[3] == gs:
                    self.items[-1] = ("flat", key, last[2], gs + 1)
                else:
                    self.items.append(("flat", key, gs, gs + 1))
        self.mixed_groups = sorted({g for own in owners if len(own) > 1 for g in own})
        # per group using families: each global stream's (family, index in the family), -1 if none
        self.family_of: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        for g, src in used:
            fam = np.full(len(self.table), -1, np.int64)
            idx = np.full(len(self.table), -1, np.int64)
            fam[self.to_global[g]] = src.family_of
            idx[self.to_global[g]] = src.index_in_family
            self.family_of[g] = (fam, idx)


def _merge_flat(parts: list[FlatRows], two_sided: bool) -> FlatRows:
    """Flat rows of several groups: sorted by (stream, D offset), neighbours of one stream merged.
    Each part is already sorted and merged; a large part takes the others by insertion."""
    z = np.zeros(0, np.int64)
    parts = [p for p in parts if len(p.s)]
    if not parts:
        return FlatRows(z, z, z, z)
    if len(parts) == 1:
        return parts[0]
    total = sum(len(p.s) for p in parts)
    big = max(parts, key=lambda p: len(p.s))
    if total > MERGE_ROWS and len(big.s) > total // 2:
        others = [p for p in parts if p is not big]
        rest = others[0] if len(others) == 1 else _sort_flat(others, two_sided)
        span = int(max(big.d.max(), rest.d.max())) + 1
        if (int(max(big.s.max(), rest.s.max())) + 1) * span < 1 << 62:
            return _insert(big, rest, span, two_sided)
    return _sort_flat(parts, two_sided)


def _sort_flat(parts: list[FlatRows], two_sided: bool) -> FlatRows:
    """Flat rows of several parts sorted by (stream, D offset) and merged."""
    s = np.concatenate([p.s for p in parts])
    d = np.concatenate([p.d for p in parts])
    p_ = np.concatenate([p.p for p in parts])
    n = np.concatenate([p.n for p in parts])
    order = np.lexsort((d, s))
    s, d, p_, n = s[order], d[order], p_[order], n[order]
    if len(n) > 1:
        cont = (s[1:] == s[:-1]) & (d[1:] == d[:-1] + n[:-1])
        if two_sided:
            cont &= p_[1:] == p_[:-1] + n[:-1]
        if cont.any():
            heads = np.flatnonzero(np.concatenate(([True], ~cont)))
            s, d, p_, n = s[heads], d[heads], p_[heads], np.add.reduceat(n, heads)
    return FlatRows(s, d, p_, n)


def _insert(big: FlatRows, small: FlatRows, span: int, two_sided: bool) -> FlatRows:
    """``small``'s rows inserted into ``big``'s in (stream, D offset) order (both sorted, disjoint on
    D); only the new neighbours are checked for a merge."""
    kb, ks = big.s * span + big.d, small.s * span + small.d
    at = np.searchsorted(kb, ks)
    if len(ks) <= 64:  # a few rows (state slots among attention pages): join slices, check the seams
        cuts = [0] + at.tolist() + [len(kb)]
        pieces: list[FlatRows] = []
        for i in range(len(ks) + 1):
            a, b = cuts[i], cuts[i + 1]
            if b > a:
                pieces.append(FlatRows(big.s[a:b], big.d[a:b], big.p[a:b], big.n[a:b]))
            if i < len(ks):
                pieces.append(FlatRows(small.s[i:i + 1], small.d[i:i + 1], small.p[i:i + 1], small.n[i:i + 1]))
        seams = False
        for x, y in zip(pieces, pieces[1:]):
            if (x.s[-1] == y.s[0] and x.d[-1] + x.n[-1] == y.d[0]
                    and (not two_sided or x.p[-1] + x.n[-1] == y.p[0])):
                seams = True
                break
        if not seams:
            return FlatRows(np.zeros(0, np.int64), z0 := np.zeros(0, np.int64), z0, z0, tuple(pieces))
    pos = at + np.arange(len(ks), dtype=np.int64)
    total = len(kb) + len(ks)
    keep = np.ones(total, bool)
    keep[pos] = False
    cols = []
    for a, b in ((big.s, small.s), (big.d, small.d), (big.p, small.p), (big.n, small.n)):
        out = np.empty(total, np.int64)
        out[keep] = a
        out[pos] = b
        cols.append(out)
    s, d, p, n = cols
    joints = np.unique(np.concatenate([pos - 1, pos]))
    joints = joints[(joints >= 0) & (joints < total - 1)]
    cont = (s[joints + 1] == s[joints]) & (d[joints + 1] == d[joints] + n[joints])
    if two_sided:
        cont &= p[joints + 1] == p[joints] + n[joints]
    if cont.any():  # rows of two groups adjacent on both sides (blocks next to each other): merge all
        full = (s[1:] == s[:-1]) & (d[1:] == d[:-1] + n[:-1])
        if two_sided:
            full &= p[1:] == p[:-1] + n[:-1]
        heads = np.flatnonzero(np.concatenate(([True], ~full)))
        s, d, p, n = s[heads], d[heads], p[heads], np.add.reduceat(n, heads)
    return FlatRows(s, d, p, n)


def _family_flat(asm: _Assembly, g: int, rows: list[FamilyRows | None], gs0: int, gs1: int,
                 wanted: np.ndarray | None) -> FlatRows:
    """The rows of group ``g``'s families for global streams ``[gs0, gs1)``, as flat rows."""
    fam_of, idx_of = asm.family_of[g]
    gs = np.arange(gs0, gs1, dtype=np.int64)
    mine = fam_of[gs0:gs1] >= 0
    if wanted is not None:
        mine &= wanted[gs0:gs1]
    gs = gs[mine]
    parts = []
    for f in np.unique(fam_of[gs]).tolist():
        fr = rows[f] if f < len(rows) else None
        if fr is None:
            continue
        sel = gs[fam_of[gs] == f]
        idx = idx_of[sel]
        if fr.split is not None:
            for g_s, i in zip(sel.tolist(), idx.tolist()):
                d, p, n = fr.split[i]
                parts.append(FlatRows(np.full(len(n), g_s, np.int64), d, p if len(p) == len(n) else d, n))
            continue
        H = len(fr.n)
        if H:
            parts.append(FlatRows(np.repeat(sel, H), (fr.family.shift_d[idx][:, None] + fr.d[None, :]).ravel(),
                                  (fr.family.shift_p[idx][:, None] + fr.p[None, :]).ravel() if len(fr.p) == H
                                  else np.zeros(len(sel) * H, np.int64), np.tile(fr.n, len(sel))))
    z = np.zeros(0, np.int64)
    if not parts:
        return FlatRows(z, z, z, z)
    if len(parts) == 1:
        return parts[0]
    s = np.concatenate([q.s for q in parts])
    order = np.lexsort((np.concatenate([q.d for q in parts]), s))
    return FlatRows(s[order], np.concatenate([q.d for q in parts])[order], np.concatenate([q.p for q in parts])[order],
                    np.concatenate([q.n for q in parts])[order])


def _mixed_blocks(asm: _Assembly, gs0: int, gs1: int, flats: dict[int, FlatRows],
                  fam_rows: dict[int, list[FamilyRows | None]], wanted: np.ndarray | None,
                  two_sided: bool) -> list[CopyBlock] | None:
    """Streams shared by one group planned by families (many rows) and others with a few flat rows
    (state slots among attention pages): each stream's family rows as views split where the few
    rows go, nothing materialized. None when the streams are not like that (or two rows of
    different groups would merge)."""
    big = [g for g in asm.mixed_groups if g in fam_rows]
    if len(big) != 1:
        return None
    g_big = big[0]
    small: list[FlatRows] = []
    for g in asm.mixed_groups:
        got = flats.get(g)
        if g != g_big and got is not None and len(got.s):
            a, b = np.searchsorted(got.s, [gs0, gs1]).tolist()
            if b > a:
                small.append(FlatRows(got.s[a:b], got.d[a:b], got.p[a:b], got.n[a:b]))
    if sum(len(f.s) for f in small) > 64 or any(g not in flats and g != g_big for g in asm.mixed_groups):
        return None
    if sum(len(fr.n) for fr in fam_rows[g_big] if fr is not None) * (gs1 - gs0) < MERGE_ROWS:
        return None  # few rows: one sort is cheaper than a block per seam
    few = _sort_flat(small, two_sided) if len(small) > 1 else small[0] if small else None
    fam_of, idx_of = asm.family_of[g_big]
    keys = asm.table.keys
    rows = fam_rows[g_big]
    z1 = np.zeros(1, np.int64)
    out: list[CopyBlock] = []
    last: tuple[int, int, int, int] | None = None  # (stream, d end, p end, -) of the previous row
    for gs in range(gs0, gs1):
        if wanted is not None and not wanted[gs]:
            continue
        f, i = int(fam_of[gs]), int(idx_of[gs])
        fr = rows[f] if f >= 0 and f < len(rows) else None
        if fr is not None and fr.split is not None:
            return None
        k = keys[gs]
        a, b = (np.searchsorted(few.s, [gs, gs + 1]).tolist()) if few is not None else (0, 0)
        sd = few.d[a:b] if few is not None else np.zeros(0, np.int64)
        if fr is None or not len(fr.n):
            base_d = np.zeros(0, np.int64)
        else:
            base_d = fr.d + fr.family.shift_d[i]
        cuts = [0] + np.searchsorted(base_d, sd).tolist() + [len(base_d)]
        for j in range(len(sd) + 1):
            lo, hi = cuts[j], cuts[j + 1]
            if hi > lo and fr is not None:
                first = (gs, int(base_d[lo]), int(fr.p[lo] + fr.family.shift_p[i]) if two_sided else 0)
                if last is not None and _touches(last, first, two_sided):
                    return None
                sh = np.array([fr.family.shift_d[i]], np.int64)
                shp = np.array([fr.family.shift_p[i]], np.int64)
                if two_sided:
                    out.append(CopyBlock(k[1:2], k[3:4], shp, k[0:1], k[2:3], sh, fr.p[lo:hi], fr.d[lo:hi],
                                         fr.n[lo:hi]))
                else:
                    none = np.zeros(1, np.int64)
                    out.append(CopyBlock(none, none, none, k[0:1], k[1:2], sh, np.zeros(hi - lo, np.int64),
                                         fr.d[lo:hi], fr.n[lo:hi]))
                e = hi - 1
                last = (gs, int(base_d[e] + fr.n[e]), int(fr.p[e] + fr.family.shift_p[i] + fr.n[e]) if two_sided else 0, 0)
            if j < len(sd) and few is not None:
                r = a + j
                first = (gs, int(few.d[r]), int(few.p[r]) if two_sided else 0)
                if last is not None and _touches(last, first, two_sided):
                    return None
                if two_sided:
                    out.append(CopyBlock(k[1:2], k[3:4], few.p[r:r + 1], k[0:1], k[2:3], few.d[r:r + 1], z1, z1,
                                         few.n[r:r + 1]))
                else:
                    none = np.zeros(1, np.int64)
                    out.append(CopyBlock(none, none, none, k[0:1], k[1:2], few.d[r:r + 1], z1, z1, few.n[r:r + 1]))
                last = (gs, int(few.d[r] + few.n[r]), int(few.p[r] + few.n[r]) if two_sided else 0, 0)
    return out


def _touches(last: tuple[int, int, int, int], first: tuple[int, int, int], two_sided: bool) -> bool:
    """Whether a row starting at ``first`` would merge with the row ending at ``last``."""
    return last[0] == first[0] and last[1] == first[1] and (not two_sided or last[2] == first[2])


def _blocks(asm: _Assembly, works: Sequence[_Work | None], two_sided: bool,
            select: tuple[int, int] | None = None) -> list[CopyBlock]:
    """Every group's rows as outer-sum blocks in the plan's order; ``select = (key column, value)``
    keeps only the streams of one rank (column 0: D rank, 1: P rank for copies)."""
    keys = asm.table.keys
    wanted = None if select is None else keys[:, select[0]] == select[1]
    fam_rows: dict[int, list[FamilyRows | None]] = {}
    flats: dict[int, FlatRows] = {}
    for g, work in enumerate(works):
        if work is None or g not in asm.flat:
            continue
        if asm.flat[g]:
            src = work.src
            rows = flat_rows(work.units, work.windows, src.unit_d, src.unit_p, two_sided)
            gs = asm.to_global[g][rows.s]
            if wanted is not None:
                keep = wanted[gs]
                flats[g] = FlatRows(gs[keep], rows.d[keep], rows.p[keep], rows.n[keep])
            else:
                flats[g] = FlatRows(gs, rows.d, rows.p, rows.n)
        else:
            fams = None
            if wanted is not None:
                fams = {f for f, fam in enumerate(work.src.families) if wanted[asm.to_global[g][fam.streams]].any()}
            fam_rows[g] = _family_rows(work, fams)
    out: list[CopyBlock] = []
    z1 = np.zeros(1, np.int64)
    items = asm.items
    if not fam_rows and len(items) > 1 and sum(len(f.s) for f in flats.values()) <= MERGE_ROWS:
        # every group flat and few rows: one sort of all of them beats a block per interleaved span
        items = [("flat", "all", 0, len(keys))]
    for item in items:
        if item[0] == "flat":
            _, key, gs0, gs1 = item
            if key == "all":
                rows = _merge_flat(list(flats.values()), two_sided)
            elif key == "mixed":
                direct = _mixed_blocks(asm, gs0, gs1, flats, fam_rows, wanted, two_sided)
                if direct is not None:
                    out.extend(direct)
                    continue
                parts = []
                for g in asm.mixed_groups:
                    got = flats.get(g)
                    if got is not None and len(got.s):
                        a, b = np.searchsorted(got.s, [gs0, gs1]).tolist()
                        parts.append(FlatRows(got.s[a:b], got.d[a:b], got.p[a:b], got.n[a:b]))
                    elif g in fam_rows:
                        parts.append(_family_flat(asm, g, fam_rows[g], gs0, gs1, wanted))
                rows = _merge_flat(parts, two_sided)
            else:
                got = flats.get(key)
                if got is None or not len(got.s):
                    continue
                a, b = np.searchsorted(got.s, [gs0, gs1]).tolist()
                rows = FlatRows(got.s[a:b], got.d[a:b], got.p[a:b], got.n[a:b])
            for part in rows.pieces or (rows,):
                if not len(part.s):
                    continue
                k = keys[part.s]
                if two_sided:
                    out.append(CopyBlock(k[:, 1], k[:, 3], part.p, k[:, 0], k[:, 2], part.d, z1, z1, part.n))
                else:
                    none = np.zeros(len(part.s), np.int64)
                    out.append(CopyBlock(none, none, none, k[:, 0], k[:, 1], part.d, z1, z1, part.n))
            continue
        _, g, f, i0, i1, gs0 = item
        got_f = fam_rows.get(g)
        fr = got_f[f] if got_f is not None else None
        if fr is None:
            continue
        fam = fr.family
        sel = np.arange(i0, i1, dtype=np.int64)
        gsel = np.arange(gs0, gs0 + i1 - i0, dtype=np.int64)
        if wanted is not None:
            keep = wanted[gsel]
            if not keep.any():
                continue
            sel, gsel = sel[keep], gsel[keep]
        k = keys[gsel]
        p_rank, p_region = (k[:, 1], k[:, 3]) if two_sided else (np.zeros(len(k), np.int64), np.zeros(len(k), np.int64))
        d_region = k[:, 2] if two_sided else k[:, 1]
        if fr.split is None:
            if len(fr.n):
                out.append(CopyBlock(p_rank, p_region, fam.shift_p[sel], k[:, 0], d_region, fam.shift_d[sel],
                                     fr.p if two_sided else np.zeros(len(fr.d), np.int64), fr.d, fr.n))
            continue
        split = [fr.split[i] for i in sel.tolist()]
        counts = np.array([len(q[2]) for q in split], np.int64)
        if counts.sum():
            out.append(CopyBlock(np.repeat(p_rank, counts), np.repeat(p_region, counts),
                                 np.concatenate([q[1] for q in split]) if two_sided
                                 else np.zeros(int(counts.sum()), np.int64),
                                 np.repeat(k[:, 0], counts), np.repeat(d_region, counts),
                                 np.concatenate([q[0] for q in split]), z1, z1, np.concatenate([q[2] for q in split])))
    return out


def _materialize(blocks: Sequence[CopyBlock], two_sided: bool) -> list[np.ndarray]:
    """The plan's columns (copies: 7, zeros: 4) from blocks, each written in place."""
    total = sum(len(b) for b in blocks)
    cols = [np.empty(total, np.int64) for _ in range(7 if two_sided else 4)]
    if two_sided:
        c_prank, c_preg, c_poff, c_drank, c_dreg, c_doff, c_n = cols
    else:
        c_drank, c_dreg, c_doff, c_n = cols
    pos = 0
    for b in blocks:
        S, H = b.streams, b.per_stream
        end = pos + S * H
        if H == 1:
            np.add(b.d_shift, b.d_base[0], out=c_doff[pos:end])
            c_n[pos:end] = b.nbytes
            c_drank[pos:end] = b.d_rank
            c_dreg[pos:end] = b.d_region
            if two_sided:
                np.add(b.p_shift, b.p_base[0], out=c_poff[pos:end])
                c_prank[pos:end] = b.p_rank
                c_preg[pos:end] = b.p_region
        else:
            shape = (S, H)
            np.add(b.d_shift[:, None], b.d_base[None, :], out=c_doff[pos:end].reshape(shape))
            c_n[pos:end].reshape(shape)[...] = b.nbytes[None, :]
            c_drank[pos:end].reshape(shape)[...] = b.d_rank[:, None]
            c_dreg[pos:end].reshape(shape)[...] = b.d_region[:, None]
            if two_sided:
                np.add(b.p_shift[:, None], b.p_base[None, :], out=c_poff[pos:end].reshape(shape))
                c_prank[pos:end].reshape(shape)[...] = b.p_rank[:, None]
                c_preg[pos:end].reshape(shape)[...] = b.p_region[:, None]
        pos = end
    return cols

