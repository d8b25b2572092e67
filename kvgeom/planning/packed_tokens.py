"""Which tokens of a range each rank pair of a packed plan carries, and where (docs/design.md §12.3):
the cut points of both sides' pages (:func:`cuts_of`), the token map of a range as runs and
arithmetic progressions folded into classes of tokens that pack alike, and their counts
(:func:`class_counts`, what the work budget estimates from).
"""

from __future__ import annotations

import attrs
import numpy as np

from ..arith.tokens import Segments, SideTokens, segments
from ..errors import InternalError
from ..values.request import BlockList, Request
from .sides import SideView

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


def _runs(segs: Segments, side: int, block: np.ndarray, tau: np.ndarray, cut: int = 0) -> np.ndarray:
    """First index of each run of segments that continue one another on ``side`` (same page, next
    slot) and in the block (same block, next position): one entry each. A side whose per-plane
    layout is affine over only ``cut`` slots (docs/design.md §3.5) never runs across a multiple of it."""
    n = len(segs)
    if n == 0:
        return np.zeros(0, np.int64)
    cont = ((segs.page[side][1:] == segs.page[side][:-1])
            & (segs.slot[side][1:] == segs.slot[side][:-1] + segs.length[:-1])
            & (block[1:] == block[:-1]) & (tau[1:] == tau[:-1] + segs.length[:-1]))
    if cut:
        cont &= segs.slot[side][1:] % cut != 0
    return np.flatnonzero(np.concatenate(([True], ~cont)))


def _merge(segs: Segments, heads: np.ndarray) -> Segments:
    length = np.add.reduceat(segs.length, heads) if len(heads) else segs.length[:0]
    return Segments(segs.start[heads], length, tuple(p[heads] for p in segs.page), tuple(s[heads] for s in segs.slot))


def _progressions(segs: Segments, side: int, block: np.ndarray, tau: np.ndarray, cut: int = 0
                  ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Fold the runs of one block and one ``side`` page into one entry when they have one length,
    slots in one step and follow one another in the block (a DCP rank's every other slot, §12.2):
    ``(head, count, slot step)`` per entry; other runs stay entries of their own (count 1, step 0).
    With ``cut`` (a per-plane side affine over that many slots, §3.5) only runs of one ``cut``-slot
    piece of the page fold."""
    n = len(segs)
    if n < 2:
        return np.arange(n, dtype=np.int64), np.ones(n, np.int64), np.zeros(n, np.int64)
    page, slot, length = segs.page[side], segs.slot[side], segs.length
    new = np.concatenate(([True], (block[1:] != block[:-1]) | (page[1:] != page[:-1])))
    if cut:
        new[1:] |= slot[1:] // cut != slot[:-1] // cut
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
             block_before: np.ndarray, cut: int = 0
             ) -> list[tuple[int, int, int, int, int, np.ndarray, np.ndarray, np.ndarray]]:
    """Runs of ``segs`` folded (:func:`_progressions`) and grouped into classes of one strided
    pattern: (first slot, tokens, count, slot step, tokens of the D block) with, per entry, the
    ``side`` page, the tokens before its D block and its position in the block. ``cut``: the
    side's slots are affine only inside pieces of that many (a per-plane layout, §3.5; 0: the page)."""
    heads = _runs(segs, side, block, tau, cut)
    run = _merge(segs, heads)
    rblock, rtau = block[heads], tau[heads]
    at, count, step = _progressions(run, side, rblock, rtau, cut)
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
    owners (D DCP rank, P DCP rank) of each segment. ``d_cut`` and ``p_cut``: a side whose per-plane
    layout is affine only over that many slots of a page (docs/design.md §3.5; 0: the whole page)."""

    d: Segments
    d_owner: tuple[np.ndarray, np.ndarray]
    p: Segments
    p_owner: tuple[np.ndarray, np.ndarray]
    d_cut: int = 0
    p_cut: int = 0

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
    """The segments of tokens ``[a, b)`` on P's and D's listings (each cut at every kernel page, and
    where a per-plane layout stops being affine: ``cut_tokens``)."""
    dsegs = segments(a, b, [dt] + ([pt] if pt.cp > 1 else []))
    psegs = segments(a, b, [pt, dt])
    return _Cuts(dsegs, (dt.owner(dsegs.start), pt.owner(dsegs.start)),
                 psegs, (dt.owner(psegs.start), pt.owner(psegs.start)), dt.cut_tokens, pt.cut_tokens)


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
    # blocks: one per D page (per affine piece of it under a per-plane layout, §3.5), in token order;
    # tokens before each segment in its block and overall
    new_page = np.concatenate(([True], dsegs.page[0][1:] != dsegs.page[0][:-1])) if len(dsegs) else \
        np.zeros(0, bool)
    if cuts.d_cut and len(dsegs):
        new_page[1:] |= dsegs.slot[0][1:] // cuts.d_cut != dsegs.slot[0][:-1] // cuts.d_cut
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
    pack = _classes(psegs, 0, p_block, p_tau, block_tokens, block_before, cuts.p_cut)
    return _TokenMap(int(dsegs.length.sum()), unpack, pack)

