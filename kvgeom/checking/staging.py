"""Staging in the simulator: a packed plan's pack steps, wire rows and unpack steps, checked and
applied chunk by chunk (docs/design.md §12.4; the steps' arithmetic is docs/design.md §12.1).

One slot per (side, rank, chunk), ``plan.staging_bytes`` long, each filled with a stale pattern
(salt "Stag", keyed by the chunk) before its chunk runs::

    for chunk c:  P slot(p, c) <--packs (elements)-- P cache      STAGING_OVERLAP: two writes of one byte
                  D slot(d, c) <--wire rows-- P slot(p, c)        STALE_STAGING: reads bytes no pack of c wrote
                  D cache      <--unpacks (elements)-- D slot(d, c)   STALE_STAGING: reads bytes no wire row of c wrote

Every element of a step is a byte range of ``unit_bytes``: its cache side comes from
:meth:`StagingStep.cache_offsets`, its staging side from :meth:`StagingStep.staging_offsets` (the
one definition). Checks work on sorted intervals, never on a mask of the whole slot:

* bounds: an element outside its engine region is OUT_OF_BOUNDS; a staging element or wire row
  outside ``[0, staging_bytes)``, or a chunk index the plan does not have, is STAGING_OUT_OF_SLOT.
  Either way the step or row is not applied.
* confinement: a pack element outside the listed P pages is FOREIGN_READ, an unpack element
  outside the writable D pages FOREIGN_WRITE (docs/design.md §4.2, invariant 1).
* overlaps: unpack elements (with copy rows) that write one D byte twice are OVERLAPPING_WRITE
  (invariant 2); pack elements or wire rows of one chunk that write one staging byte twice are
  STAGING_OVERLAP (invariant 7).
* staleness: a wire row reading P slot bytes no pack of its chunk wrote, or an unpack element
  reading D slot bytes no wire row of its chunk wrote, is STALE_STAGING (invariant 7).
* minimality: two wire rows of one (chunk, P rank, D rank) adjacent on both sides are NOT_MINIMAL
  (invariant 5).

Worked number: a wire row reading P slot bytes [0, 409600) when the chunk's packs wrote
[0, 393216) and [409600, ...) leaves [393216, 409600) unwritten: one STALE_STAGING of 16,384 B.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np

from ..values.engine import EngineGeometry
from ..values.pair import CheckedEngines
from ..values.plan import TransferPlan
from ..values.request import Request
from ..values.staging import StagingStep
from .bounds import _held_sizes
from .describe import describe
from .hashing import fill_pattern
from .memory import CHUNK, Memory
from .report import Sink, Violation, ViolationKind

__all__: list[str] = []

SALT_STAGING = 0x53_74_61_67  # "Stag": a slot's bytes before its chunk's packs (or wire rows) write them


def _elements(step: StagingStep, limit: int = CHUNK) -> Iterator[tuple[int, np.ndarray, np.ndarray]]:
    """(layer entry, cache starts, staging starts) of every element, flat, in pieces of about
    ``limit`` elements."""
    per = max(1, step.elements)
    pages = max(1, limit // per)
    for lam in range(len(step.regions)):
        for k in range(0, len(step.pages), pages):
            sel = slice(k, k + pages)
            yield lam, step.cache_offsets(lam, sel).ravel(), step.staging_offsets(lam, sel).ravel()


def _side(step: StagingStep) -> str:
    return step.side


def step_problem(engine: EngineGeometry, step: StagingStep, chunks: int, slot: int,
                 held: np.ndarray | None = None) -> tuple[ViolationKind, str] | None:
    """Why ``step`` leaves its engine or its slot (None when it does not). ``held`` is
    ``[rank, region]`` bytes (0 where the rank's stage does not hold the region, docs/design.md
    §11.4); computed when not given."""
    if not 0 <= step.rank < engine.num_ranks:
        return ViolationKind.OUT_OF_BOUNDS, f"rank {step.rank} outside the engine's {engine.num_ranks} ranks"
    n_regions = len(engine.regions)
    if len(step.regions) and (int(step.regions.max()) >= n_regions or int(step.regions.min()) < 0):
        return ViolationKind.OUT_OF_BOUNDS, f"region {int(step.regions.max())} does not exist ({n_regions} regions)"
    span = sum((n - 1) * s for n, s in zip(step.shape, step.cache_strides)) + step.unit_bytes
    if len(step.regions) and len(step.pages):
        sizes = (held if held is not None else _held_sizes(engine))[step.rank][step.regions]
        end = int(step.pages.max()) * step.page_bytes + step.offsets + span
        if np.any(end > sizes):
            i = int(np.argmax(end > sizes))
            whose = "" if sizes[i] else f", held by another pipeline stage than rank {step.rank}'s"
            return ViolationKind.OUT_OF_BOUNDS, (f"layer entry {i}: elements reach byte {int(end[i])} of region "
                                                 f"{int(step.regions[i])} ({int(sizes[i])} B{whose})")
    if step.chunk >= chunks:
        return ViolationKind.STAGING_OUT_OF_SLOT, f"chunk {step.chunk} is not one of the plan's {chunks} chunks"
    lo, hi = step.staging_span()
    if hi > slot:
        return ViolationKind.STAGING_OUT_OF_SLOT, f"staging bytes [{lo}, {hi}) pass the {slot} B slot"
    return None


def packed_bounds(P: EngineGeometry, D: EngineGeometry, plan: TransferPlan,
                  sink: Sink) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Masks of packs, unpacks and wire rows that leave their engine or slot (reported, not applied)."""
    chunks, slot = len(plan.chunks), plan.staging_bytes
    masks = []
    for name, engine, steps in (("pack", P, plan.packs), ("unpack", D, plan.unpacks)):
        bad = np.zeros(len(steps), bool)
        held = _held_sizes(engine)
        for k, st in enumerate(steps):
            why = step_problem(engine, st, chunks, slot, held)
            if why is not None:
                bad[k] = True
                sink.one(Violation(why[0], st.side, st.rank, int(st.regions[0]) if len(st.regions) else -1, 0,
                                   0, "", f"{name} step {k}: {why[1]}"), st.nbytes)
        masks.append(bad)
    w = plan.wire
    rank_bad = (w.p_rank < 0) | (w.p_rank >= P.num_ranks) | (w.d_rank < 0) | (w.d_rank >= D.num_ranks)
    slot_bad = ~rank_bad & ((w.chunk >= chunks) | (w.p_offset + w.nbytes > slot) | (w.d_offset + w.nbytes > slot))
    for kind, bad in ((ViolationKind.OUT_OF_BOUNDS, rank_bad), (ViolationKind.STAGING_OUT_OF_SLOT, slot_bad)):
        rows = np.flatnonzero(bad)

        def make(i: int, rows: np.ndarray = rows, kind: ViolationKind = kind) -> Violation:
            r = int(rows[i])
            where = "its engines" if kind is ViolationKind.OUT_OF_BOUNDS else f"the {slot} B slots of {chunks} chunks"
            return Violation(kind, "decode", int(w.d_rank[r]), -1, int(w.d_offset[r]), int(w.nbytes[r]), "",
                             f"wire row {r} (chunk {int(w.chunk[r])}, P{int(w.p_rank[r])} [{int(w.p_offset[r])}, "
                             f"+{int(w.nbytes[r])}) -> D{int(w.d_rank[r])} [{int(w.d_offset[r])}, +{int(w.nbytes[r])})) "
                             f"leaves {where}")

        sink.add(kind, len(rows), int(w.nbytes[rows].sum()), make)
    masks.append(rank_bad | slot_bad)
    return masks[0], masks[1], masks[2]


# ---- intervals ---------------------------------------------------------------------------------------

def _merged(starts: np.ndarray, ends: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The union of ``[starts, ends)`` as sorted disjoint intervals (touching ones merged)."""
    if not len(starts):
        return starts, ends
    order = np.argsort(starts, kind="stable")
    s, e = starts[order], ends[order]
    run_end = np.maximum.accumulate(e)
    new = np.concatenate(([True], s[1:] > run_end[:-1]))
    heads = np.flatnonzero(new)
    tails = np.append(heads[1:], len(s)) - 1
    return s[heads], run_end[tails]


def _overlaps(starts: np.ndarray, ends: np.ndarray) -> np.ndarray:
    """Indices of intervals that start before an earlier-starting interval ends."""
    if len(starts) < 2:
        return np.zeros(0, np.int64)
    order = np.argsort(starts, kind="stable")
    s, e = starts[order], ends[order]
    prev = np.concatenate(([np.iinfo(np.int64).min], np.maximum.accumulate(e)[:-1]))
    return order[s < prev]


def _uncovered(read_s: np.ndarray, read_e: np.ndarray, have_s: np.ndarray, have_e: np.ndarray) -> np.ndarray:
    """Indices of reads ``[read_s, read_e)`` not wholly inside the union of the ``have`` intervals;
    ``have`` must be merged (sorted, disjoint)."""
    if not len(read_s):
        return np.zeros(0, np.int64)
    if not len(have_s):
        return np.arange(len(read_s))
    i = np.searchsorted(have_s, read_s, side="right") - 1
    ok = (i >= 0) & (have_e[np.maximum(i, 0)] >= read_e)
    return np.flatnonzero(~ok)


def _first_gap(a: int, b: int, have_s: np.ndarray, have_e: np.ndarray) -> tuple[int, int]:
    """The first unwritten byte range inside [a, b)."""
    pos = a
    i = int(np.searchsorted(have_s, pos, side="right")) - 1
    if i >= 0 and have_e[i] > pos:
        pos = int(have_e[i])
    j = int(np.searchsorted(have_s, pos, side="left"))
    end = min(b, int(have_s[j])) if j < len(have_s) else b
    return pos, max(pos + 1, end)


# ---- the checks ---------------------------------------------------------------------------------------

def _confined(sink: Sink, kind: ViolationKind, engine: EngineGeometry, request: Request,
              allowed: dict[int, np.ndarray], steps: tuple[StagingStep, ...], bad: np.ndarray, what: str) -> None:
    """Steps whose elements touch a page outside ``allowed`` (one violation per step and layer entry)."""
    for k, st in enumerate(steps):
        if bad[k]:
            continue
        for lam in range(len(st.regions)):
            region = int(st.regions[lam])
            mask = allowed.get(region)
            pb = engine.regions[region].page_bytes
            starts = st.cache_offsets(lam)
            first, last = starts // pb, (starts + st.unit_bytes - 1) // pb
            if mask is None:
                off = np.ones(first.shape, bool)
            else:
                foreign_before = np.concatenate(([0], np.cumsum(~mask)))
                off = foreign_before[last + 1] - foreign_before[first] > 0
            hit = np.flatnonzero(off.ravel())
            if not hit.size:
                continue
            at = int(starts.ravel()[hit[0]])

            def make(i: int, st: StagingStep = st, k: int = k, lam: int = lam, region: int = region,
                     at: int = at, n: int = hit.size, pb: int = pb) -> Violation:
                return Violation(kind, st.side, st.rank, region, at, st.unit_bytes,
                                 describe(engine, request, st.side, st.rank, region, at),
                                 f"{what} step {k} layer entry {lam}: {n} elements touch pages this request does "
                                 f"not list (first at byte {at}, page {at // pb})")

            sink.add(kind, 1, int(hit.size) * st.unit_bytes, make)


def _d_writes(plan: TransferPlan, copy_keep: np.ndarray, unpack_bad: np.ndarray) -> dict[tuple[int, int], list]:
    """Per (D rank, region): (starts, ends, labels) of every copy row and unpack element."""
    out: dict[tuple[int, int], list] = {}
    c = plan.copies.take(np.flatnonzero(copy_keep))
    if len(c):
        keys = np.stack([c.d_rank, c.d_region], axis=1)
        uniq, inv = np.unique(keys, axis=0, return_inverse=True)
        for j, (rank, region) in enumerate(uniq.tolist()):
            rows = np.flatnonzero(inv.reshape(-1) == j)
            out.setdefault((rank, region), []).append((c.d_offset[rows], c.d_offset[rows] + c.nbytes[rows], "copy"))
    for k, st in enumerate(plan.unpacks):
        if unpack_bad[k]:
            continue
        for lam, cache, _ in _elements(st):
            key = (st.d_rank, int(st.regions[lam]))
            out.setdefault(key, []).append((cache, cache + st.unit_bytes, f"unpack step {k}"))
    return out


def packed_checks(pair: CheckedEngines, request: Request, plan: TransferPlan, p_allowed: dict[int, np.ndarray],
                  d_allowed: dict[int, np.ndarray], copy_keep: np.ndarray,
                  masks: tuple[np.ndarray, np.ndarray, np.ndarray], sink: Sink) -> None:
    """Every plan-level check of the packed parts (see the module docstring) into ``sink``."""
    P, D = pair.prefill, pair.decode
    pack_bad, unpack_bad, wire_bad = masks
    _confined(sink, ViolationKind.FOREIGN_READ, P, request, p_allowed, plan.packs, pack_bad, "pack")
    _confined(sink, ViolationKind.FOREIGN_WRITE, D, request, d_allowed, plan.unpacks, unpack_bad, "unpack")
    # D bytes written twice (copies and unpack elements together)
    if plan.unpacks:
        for (rank, region), parts in _d_writes(plan, copy_keep, unpack_bad).items():
            if not any(label.startswith("unpack") for _, _, label in parts):
                continue  # copies alone are checked by plan_checks
            starts = np.concatenate([s for s, _, _ in parts])
            ends = np.concatenate([e for _, e, _ in parts])
            hit = _overlaps(starts, ends)
            if hit.size:
                at = int(starts[hit[0]])

                def overlap(i: int, rank: int = rank, region: int = region, at: int = at) -> Violation:
                    return Violation(ViolationKind.OVERLAPPING_WRITE, "decode", rank, region, at, 0,
                                     describe(D, request, "decode", rank, region, at),
                                     "an unpack element writes D bytes another unpack element or copy row also writes")

                sink.add(ViolationKind.OVERLAPPING_WRITE, int(hit.size), int((ends[hit] - starts[hit]).sum()), overlap)
    w = plan.wire
    wk = np.flatnonzero(~wire_bad)
    for chunk in sorted({st.chunk for st in plan.packs + plan.unpacks} | {int(c) for c in w.chunk[wk]}):
        _chunk_checks(D, request, plan, chunk, pack_bad, unpack_bad, wk[w.chunk[wk] == chunk], sink)
    # two wire rows of one (chunk, P rank, D rank) that could merge
    if len(wk) > 1:
        key = np.stack([w.chunk[wk], w.p_rank[wk], w.d_rank[wk]], axis=1).tolist()
        row_ends = {tuple(k) + (int(po) + int(n), int(do) + int(n)) for k, po, do, n in
                    zip(key, w.p_offset[wk], w.d_offset[wk], w.nbytes[wk])}
        merge = [int(r) for r, k, po, do in zip(wk, key, w.p_offset[wk], w.d_offset[wk])
                 if tuple(k) + (int(po), int(do)) in row_ends]

        def mergeable(i: int) -> Violation:
            r = merge[i]
            return Violation(ViolationKind.NOT_MINIMAL, "decode", int(w.d_rank[r]), -1, int(w.d_offset[r]),
                             int(w.nbytes[r]), "", f"wire row {r} starts where another row of its (chunk, P rank, "
                             "D rank) ends on both sides: they could merge")

        sink.add(ViolationKind.NOT_MINIMAL, len(merge), 0, mergeable)


def _staging_overlap(sink: Sink, side: str, rank: int, chunk: int, starts: np.ndarray, ends: np.ndarray,
                     what: str) -> None:
    """STAGING_OVERLAP for the writes ``[starts, ends)`` of one slot (one per byte range written twice)."""
    hit = _overlaps(starts, ends)
    if not hit.size:
        return
    at = int(starts[hit[0]])

    def make(i: int) -> Violation:
        return Violation(ViolationKind.STAGING_OVERLAP, side, rank, -1, at, 0, f"chunk {chunk} slot",
                         f"{what} of chunk {chunk} write {side} rank {rank}'s slot byte {at} twice")

    sink.add(ViolationKind.STAGING_OVERLAP, int(hit.size), int((ends[hit] - starts[hit]).sum()), make)


def _chunk_checks(D: EngineGeometry, request: Request, plan: TransferPlan, chunk: int, pack_bad: np.ndarray,
                  unpack_bad: np.ndarray, wire_rows: np.ndarray, sink: Sink) -> None:
    """STAGING_OVERLAP and STALE_STAGING of one chunk."""
    w = plan.wire
    written_p: dict[int, list[tuple[np.ndarray, np.ndarray]]] = {}
    for k, st in enumerate(plan.packs):
        if pack_bad[k] or st.chunk != chunk:
            continue
        for _, _, staging in _elements(st):
            written_p.setdefault(st.p_rank, []).append((staging, staging + st.unit_bytes))
    merged_p = {}
    for rank, parts in written_p.items():
        s = np.concatenate([a for a, _ in parts])
        e = np.concatenate([b for _, b in parts])
        _staging_overlap(sink, "prefill", rank, chunk, s, e, "pack elements")
        merged_p[rank] = _merged(s, e)
    # wire rows: reads of P slots, writes of D slots
    written_d: dict[int, list[tuple[np.ndarray, np.ndarray]]] = {}
    for r in wire_rows.tolist():
        p, d = int(w.p_rank[r]), int(w.d_rank[r])
        a, n = int(w.p_offset[r]), int(w.nbytes[r])
        have = merged_p.get(p, (np.zeros(0, np.int64), np.zeros(0, np.int64)))
        if _uncovered(np.array([a]), np.array([a + n]), *have).size:
            gap = _first_gap(a, a + n, *have)
            sink.one(Violation(ViolationKind.STALE_STAGING, "prefill", p, -1, gap[0], gap[1] - gap[0],
                               f"chunk {chunk} slot", f"wire row {r} reads P rank {p}'s slot bytes [{gap[0]}, "
                               f"{gap[1]}), which no pack of chunk {chunk} wrote"))
        written_d.setdefault(d, []).append((np.array([int(w.d_offset[r])]), np.array([int(w.d_offset[r]) + n])))
    merged_d = {}
    for rank, parts in written_d.items():
        s = np.concatenate([a for a, _ in parts])
        e = np.concatenate([b for _, b in parts])
        _staging_overlap(sink, "decode", rank, chunk, s, e, "wire rows")
        merged_d[rank] = _merged(s, e)
    for k, st in enumerate(plan.unpacks):
        if unpack_bad[k] or st.chunk != chunk:
            continue
        have = merged_d.get(st.d_rank, (np.zeros(0, np.int64), np.zeros(0, np.int64)))
        stale = 0
        first = -1
        for _, _, staging in _elements(st):
            miss = _uncovered(staging, staging + st.unit_bytes, *have)
            if miss.size and first < 0:
                first = int(staging[miss[0]])
            stale += int(miss.size)
        if stale:
            sink.one(Violation(ViolationKind.STALE_STAGING, "decode", st.d_rank, -1, first, st.unit_bytes,
                               f"chunk {chunk} slot", f"unpack step {k}: {stale} elements read D rank {st.d_rank}'s "
                               f"slot bytes no wire row of chunk {chunk} wrote (first at {first})"),
                     stale * st.unit_bytes)


# ---- applying -----------------------------------------------------------------------------------------

def _extents(plan: TransferPlan, chunk: int, rows: np.ndarray, pack_bad: np.ndarray,
             unpack_bad: np.ndarray) -> dict[tuple[str, int], int]:
    """Per (side, rank), the end of the slot bytes ``chunk`` touches (never past staging_bytes: rows
    and steps beyond were set aside), so a simulated slot is only as long as its chunk needs."""
    extent: dict[tuple[str, int], int] = {}

    def need(side: str, rank: int, end: int) -> None:
        extent[(side, rank)] = max(extent.get((side, rank), 0), end)

    for steps, bad in ((plan.packs, pack_bad), (plan.unpacks, unpack_bad)):
        for k, st in enumerate(steps):
            if not bad[k] and st.chunk == chunk:
                need(st.side, st.rank, st.staging_span()[1])
    w = plan.wire
    for r in rows.tolist():
        need("prefill", int(w.p_rank[r]), int(w.p_offset[r] + w.nbytes[r]))
        need("decode", int(w.d_rank[r]), int(w.d_offset[r] + w.nbytes[r]))
    return extent


def apply_packed(plan: TransferPlan, pmem: Memory, dmem: Memory,
                 masks: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None) -> None:
    """Run every chunk's packs, wire rows and unpacks in order (steps and rows flagged in ``masks``
    are left out); slots start each chunk with the stale pattern."""
    if not plan.packed:
        return
    pack_bad, unpack_bad, wire_bad = masks if masks is not None else (
        np.zeros(len(plan.packs), bool), np.zeros(len(plan.unpacks), bool), np.zeros(len(plan.wire), bool))
    w = plan.wire
    chunks = sorted({st.chunk for st in plan.packs} | {st.chunk for st in plan.unpacks} | set(w.chunk.tolist()))
    for chunk in chunks:
        rows = np.flatnonzero((w.chunk == chunk) & ~wire_bad)
        extent = _extents(plan, chunk, rows, pack_bad, unpack_bad)
        p_slots: dict[int, np.ndarray] = {}
        d_slots: dict[int, np.ndarray] = {}

        def slot_of(slots: dict[int, np.ndarray], side: str, rank: int, extent: dict[tuple[str, int], int] = extent,
                    chunk: int = chunk) -> np.ndarray:
            if rank not in slots:
                buf = np.zeros(extent[(side, rank)], np.uint8)
                fill_pattern(buf, SALT_STAGING, rank + (0 if side == "prefill" else 1 << 16), chunk)
                slots[rank] = buf
            return slots[rank]

        for k, st in enumerate(plan.packs):
            if pack_bad[k] or st.chunk != chunk:
                continue
            buf = slot_of(p_slots, "prefill", st.p_rank)
            unit = np.arange(st.unit_bytes, dtype=np.int64)
            for lam, cache, staging in _elements(st, CHUNK // max(1, st.unit_bytes)):
                src = pmem.buffers[st.p_rank][int(st.regions[lam])]
                buf[(staging[:, None] + unit).ravel()] = src[(cache[:, None] + unit).ravel()]
        for r in rows.tolist():
            p, d, n = int(w.p_rank[r]), int(w.d_rank[r]), int(w.nbytes[r])
            src = slot_of(p_slots, "prefill", p)
            dst = slot_of(d_slots, "decode", d)
            dst[int(w.d_offset[r]):int(w.d_offset[r]) + n] = src[int(w.p_offset[r]):int(w.p_offset[r]) + n]
        for k, st in enumerate(plan.unpacks):
            if unpack_bad[k] or st.chunk != chunk:
                continue
            buf = slot_of(d_slots, "decode", st.d_rank)
            unit = np.arange(st.unit_bytes, dtype=np.int64)
            for lam, cache, staging in _elements(st, CHUNK // max(1, st.unit_bytes)):
                dst = dmem.buffers[st.d_rank][int(st.regions[lam])]
                dst[(cache[:, None] + unit).ravel()] = buf[(staging[:, None] + unit).ravel()]
