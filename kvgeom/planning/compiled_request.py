"""The compiled pair's per-request engine (docs/design.md §13): the compiled state of a pair and
what one request makes of it. :class:`_RequestEngine` holds the patterns compiled once
(:mod:`kvgeom.planning.compile_step`), checks a request on a fast path (the reference check raises
the exact error otherwise), turns each attention group's window ``[lo, hi)`` into units (the D pages
it touches, their kinds and P pages) with the rows the reference emits before coalescing, does the
same for zeros and state slots, and weighs direct against staged per group for auto by what each
posts. :class:`~kvgeom.planning.compiled.CompiledPair` is its public face.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import attrs
import numpy as np

from ..arith.tokens import segments, window_start
from ..errors import InternalError
from ..values.blocks import CopyBlock
from ..values.model import AttentionSpec
from ..values.notes import Note, NoteKind
from ..values.pair import CheckedEngines
from ..values.plan import Rearrange
from ..values.request import BlockList, Request, StateSlots
from .assembly import _Assembly, _blocks, _Work
from .attention import nothing_note, segments_note, source_notes, zeroed_note
from .budget import PlanBudget
from .choose import CostModel
from .compile_step import _AttentionCopies, _AttentionZeros, _cuts_inside, _ids, _Source, _StateCopies, _tokens
from .pieces import Pieces, Units
from .staged import ArrivedView, arrival, staged_rearrange_shape
from .state import paired_slots, state_notes
from .topology import topology_notes

logger = logging.getLogger(__name__)
FAMILY_LIMIT = 4  # a group with more families, or one unit, is planned stream by stream in one pass (flat)
FLAT_ROWS = 65536  # ... unless it gives more rows than this: families then write in place (no temporaries)


# ---- the compiled pair -----------------------------------------------------------------------------------


@attrs.frozen(eq=False)
class _Group:
    """One group's part of one request: its work (None: no rows), counts, notes, rearranges."""

    copies: _Work | None
    zeros: _Work | None
    raw_copies: int
    raw_zeros: int
    notes: tuple[Note, ...]
    rearranges: tuple[Rearrange, ...] = ()
    variant: str = "direct"
    cost: float = 0.0  # auto: what this group's chosen plan posts and rearranges, in seconds


class _RequestEngine:
    """The compiled state of a pair (its patterns, built once) and the rows of one request: the checks'
    fast path, each group's pages and zeros as units, and what a group alone posts (docs/design.md §13)."""

    def __init__(self, pair: CheckedEngines) -> None:
        self.pair = pair
        P, D = pair.prefill, pair.decode
        self.direct: dict[int, _AttentionCopies] = {}
        self.staged: dict[int, _AttentionCopies | str] = {}
        self.staged_kind: dict[int, NoteKind] = {}
        self.rearranges: dict[int, tuple[tuple[Rearrange, ...], int]] = {}  # templates, bytes per page
        self.zeros: dict[int, _AttentionZeros] = {}
        self.states: dict[int, _StateCopies] = {}
        self.sources: dict[int, tuple[Note, ...]] = {}
        for gi, spec in enumerate(pair.model.groups):
            if isinstance(spec, AttentionSpec):
                self.direct[gi] = _AttentionCopies(pair, gi, None)
                self.zeros[gi] = _AttentionZeros(pair, gi)
                self.sources[gi] = source_notes(pair, gi)
                self._compile_staged(gi, spec)
            else:
                self.states[gi] = _StateCopies(pair, gi)
        self.topology = topology_notes(pair)
        self._copy_widths = (D.num_ranks, P.num_ranks, len(D.regions), len(P.regions))
        self._assemblies: dict[tuple[Any, ...], _Assembly] = {}
        self._pool = {side: [min(eng.num_logical_blocks(r) for r in eng.group_regions(gi))
                               for gi in range(len(pair.model.groups))]
                        for side, eng in (("prefill", P), ("decode", D))}
        self._shared = {side: self._sharing(eng) for side, eng in (("prefill", P), ("decode", D))}
        # one request's group work, kept for the other of plan() and copy_blocks() (an executor asks both)
        self._last: tuple[Request, tuple[str, CostModel, int, PlanBudget | None], Any, str, tuple[Note, ...]] | None = None
        self._id_arrays: dict[int, tuple[BlockList, np.ndarray]] = {}

    def _compile_staged(self, gi: int, spec: AttentionSpec) -> None:
        P, D = self.pair.prefill, self.pair.decode
        arr = arrival(P, D, gi)
        if isinstance(arr, str):
            self.staged[gi] = f"{spec.name}: staged does not apply ({arr}); direct copies"
            self.staged_kind[gi] = NoteKind.STAGED_NOT_APPLICABLE
            return
        shape = staged_rearrange_shape(D, gi, arr)
        if shape is None:
            self.staged[gi] = f"{spec.name}: arrived layout equals D's layout; staged = direct"
            self.staged_kind[gi] = NoteKind.STAGED_EQUALS_DIRECT
            return
        self.staged[gi] = _AttentionCopies(self.pair, gi, ArrivedView(D, gi, arr))
        # every shape through Rearrange's own checks, once; a request's copies take its pages
        templates = tuple(Rearrange(pages=(0,), **kw) for kw in shape["rearranges"])
        self.rearranges[gi] = (templates, sum(r.nbytes_per_page for r in templates))

    def _sharing(self, eng: Any) -> list[tuple[int, ...]]:
        users: dict[int, list[int]] = {}
        for gi in range(len(self.pair.model.groups)):
            for region in eng.group_regions(gi):
                users.setdefault(region, []).append(gi)
        return sorted({tuple(g) for g in users.values() if len(g) > 1})

    def _ids(self, listing: BlockList) -> np.ndarray:
        """A listing's ids as an array, converted once per request (kept until the next request)."""
        got = self._id_arrays.get(id(listing))
        if got is None or got[0] is not listing:
            got = (listing, _ids(listing))
            self._id_arrays[id(listing)] = got
        return got[1]

    # ---- request checks -------------------------------------------------------------------------------
    def _valid(self, request: Request) -> bool:
        """True when ``request`` certainly passes :meth:`CheckedEngines.check_request` (the fast path);
        False sends it to the reference check, which raises the exact error (or accepts it)."""
        pair = self.pair
        groups = pair.model.groups
        if len(request.groups) != len(groups):
            return False
        M, S = request.computed_tokens, request.prefix_hit_tokens
        P, D = pair.prefill, pair.decode
        if S % D.logical_block_tokens:
            return False
        for gi, (spec, gr) in enumerate(zip(groups, request.groups)):
            for side, eng in (("prefill", P), ("decode", D)):
                listing = getattr(gr, side)
                if isinstance(spec, AttentionSpec):
                    if not isinstance(listing, BlockList):
                        return False
                    ids = listing.block_ids
                    B = eng.logical_block_tokens
                    first = listing.first_token
                    if first % B:
                        return False
                    if not request.partial:
                        ws = window_start(M, spec.window_tokens)
                        lo = min(ws if side == "prefill" else max(S, ws), M)
                        end = first + len(ids) * B
                        if lo < M and (first > lo or end < M):
                            return False
                        if ids and (end - B >= M if side == "prefill" else end - B > M):
                            return False
                else:
                    if not isinstance(listing, StateSlots):
                        return False
                    ids = listing.slot_ids
                    if side == "prefill" and listing.tokens and max(listing.tokens) > M:
                        return False
                    if not request.partial:
                        if side == "decode" and listing.tokens and max(listing.tokens) > M:
                            return False
                        if S < M and M not in listing.tokens:
                            return False
                if ids and (max(ids) if len(ids) < 64 or not isinstance(listing, BlockList)
                            else int(self._ids(listing).max())) >= self._pool[side][gi]:
                    return False
        for side in ("prefill", "decode"):
            for gis in self._shared[side]:
                seen: set[int] = set()
                total = 0
                for gi in gis:
                    listing = getattr(request.groups[gi], side)
                    got = listing.block_ids if isinstance(listing, BlockList) else listing.slot_ids
                    seen.update(got)
                    total += len(got)
                if len(seen) != total:
                    return False
        return True

    def _posted(self, gi: int, work: _Work | None, variant: str, raw: int, cost_model: CostModel) -> tuple[int, bool]:
        """What group ``gi`` alone posts (:func:`kvgeom.planning.choose.posted`): its rows after
        coalescing when there are at most ``cost_model.exact_rows`` before, else that count."""
        if raw > cost_model.exact_rows:
            return raw, False
        works: list[_Work | None] = [None] * len(self.pair.model.groups)
        works[gi] = work
        variants = tuple(variant if i == gi else "none" for i in range(len(works)))
        return sum(len(b) for b in self._blocks_of(works, variants, True, None)), True

    def _source(self, gi: int, variant: str) -> _Source | None:
        if variant == "none":
            return None
        if variant == "state":
            return self.states[gi]
        if variant == "zeros":
            return self.zeros.get(gi)
        got = self.staged[gi] if variant == "staged" else self.direct[gi]
        return got if isinstance(got, _Source) else None

    def _blocks(self, groups: Sequence[_Group], two_sided: bool, select: tuple[int, int] | None) -> list[CopyBlock]:
        works = [g.copies if two_sided else g.zeros for g in groups]
        variants = tuple(g.variant if two_sided else "zeros" for g in groups)
        return self._blocks_of(works, variants, two_sided, select)

    def _blocks_of(self, works: Sequence[_Work | None], variants: tuple[str, ...], two_sided: bool,
                   select: tuple[int, int] | None) -> list[CopyBlock]:
        flat = tuple(w is not None and (len(w.units.g) == 1 or (len(w.src.families) > FAMILY_LIMIT
                                                              and len(w.units.g) * w.src.pieces_per_unit < FLAT_ROWS))
                     for w in works)
        key = (two_sided, variants, flat)
        asm = self._assemblies.get(key)
        if asm is None:
            sources = [self._source(gi, v) for gi, v in enumerate(variants)]
            D = self.pair.decode
            widths = self._copy_widths if two_sided else (D.num_ranks, len(D.regions))
            asm = _Assembly(sources, widths, flat)
            self._assemblies[key] = asm
        return _blocks(asm, works, two_sided, select)

    # ---- attention groups -----------------------------------------------------------------------------
    def _attention(self, request: Request, gi: int, spec: AttentionSpec, strategy: str,
                   cost_model: CostModel) -> _Group:
        g = request.groups[gi]
        if not (isinstance(g.prefill, BlockList) and isinstance(g.decode, BlockList)):
            raise InternalError("checked with the pair")
        p_list, d_list = g.prefill, g.decode
        P, D = self.pair.prefill, self.pair.decode
        M = request.computed_tokens
        p0, p1 = p_list.token_range(P.logical_block_tokens)
        d0, d1 = d_list.token_range(D.logical_block_tokens)
        lo = max(request.prefix_hit_tokens, d0, p0, window_start(M, spec.window_tokens))
        hi = min(M, d1, p1)
        zwork, raw_z, z_notes = self._zeros(request, gi, d_list, lo, hi)
        staged = self.staged[gi]
        direct = self.direct[gi]
        if strategy == "direct" or isinstance(staged, str):
            work, raw, nseg = self._pages(direct, p_list, d_list, lo, hi)
            notes = self._notes(gi, lo, hi, nseg) + z_notes
            cost = 0.0
            if strategy != "direct" and isinstance(staged, str):
                if strategy == "staged":
                    note = Note(self.staged_kind[gi], staged)
                    if note.kind is NoteKind.STAGED_NOT_APPLICABLE:
                        logger.warning("staged asked for, direct planned instead: %s", note.text)
                    notes += (note,)
                else:
                    logger.debug("%s: auto: staged does not apply or changes nothing -> direct", spec.name)
                    cost = cost_model.cost(self._posted(gi, work, "direct", raw, cost_model)[0], 0)
            return _Group(work, zwork, raw, raw_z, notes, cost=cost)
        s_work, s_raw, s_nseg = self._pages(staged, p_list, d_list, lo, hi)
        pages = tuple(s_work.units.g.tolist()) if s_work is not None else ()
        rearranges: tuple[Rearrange, ...] = ()
        moved = 0
        if pages:
            templates, per_page = self.rearranges[gi]
            rearranges = tuple(r.with_pages(pages) for r in templates)
            moved = per_page * len(pages)
        arr = staged.ds.arr if isinstance(staged.ds, ArrivedView) else None
        if arr is None:
            raise InternalError("a staged source lands in an arrived view")
        staged_note = Note(NoteKind.STAGED, f"{spec.name}: staged: P pages land in sub-pages of {arr.sub_tokens} "
                           f"tokens in P's mode order, then {len(rearranges)} rearranges move {moved} B into D's layout")
        if strategy == "staged":
            notes = self._notes(gi, lo, hi, s_nseg) + z_notes + (staged_note,)
            return _Group(s_work, zwork, s_raw, raw_z, notes, rearranges, "staged")
        # auto: the cheaper of direct and staged by what each posts (kvgeom.planning.choose.choose_group)
        work, raw, nseg = self._pages(direct, p_list, d_list, lo, hi)
        n_direct, exact_d = self._posted(gi, work, "direct", raw, cost_model)
        cost_d = cost_model.cost(n_direct, 0)
        if not rearranges:  # nothing to rearrange, so staged would change nothing
            logger.debug("%s: auto: staged does not apply or changes nothing -> direct", spec.name)
            return _Group(work, zwork, raw, raw_z, self._notes(gi, lo, hi, nseg) + z_notes, cost=cost_d)
        n_staged, exact_s = self._posted(gi, s_work, "staged", s_raw, cost_model)
        cost_s = cost_model.cost(n_staged, moved)

        def counted(count: int, exact: bool) -> str:
            return f"{count} copies posted" + ("" if exact else " (estimate: count before coalescing)")

        why = (f"{spec.name}: auto: direct {counted(n_direct, exact_d)} = {cost_d * 1e6:.1f} us; staged "
               f"{counted(n_staged, exact_s)} + {moved} B rearranged = {cost_s * 1e6:.1f} us ({cost_model.describe()})")
        if cost_s < cost_d:
            logger.debug("%s -> staged", why)
            notes = self._notes(gi, lo, hi, s_nseg) + z_notes + (staged_note,
                                                                  Note(NoteKind.AUTO_STAGED, why + " -> staged"))
            return _Group(s_work, zwork, s_raw, raw_z, notes, rearranges, "staged", cost_s)
        logger.debug("%s -> direct", why)
        notes = self._notes(gi, lo, hi, nseg) + z_notes + (Note(NoteKind.AUTO_DIRECT, why + " -> direct"),)
        return _Group(work, zwork, raw, raw_z, notes, cost=cost_d)

    def _notes(self, gi: int, lo: int, hi: int, nseg: int) -> tuple[Note, ...]:
        if hi > lo:
            return (segments_note(self.pair, gi, lo, hi, nseg),) + self.sources[gi]
        return (nothing_note(self.pair, gi),)

    def _pages(self, var: _AttentionCopies, p_list: BlockList, d_list: BlockList, lo: int,
               hi: int) -> tuple[_Work | None, int, int]:
        """The D pages of ``[lo, hi)`` as units sorted by id (with their kinds and P pages), the rows
        the reference emits before coalescing, and the aligned segments."""
        if hi <= lo:
            return None, 0, 0
        sd = var.span_d
        if lo // sd == (hi - 1) // sd:
            return self._page(var, p_list, d_list, lo, hi)
        P, D = self.pair.prefill, self.pair.decode
        sp = var.span_p
        v_abs = np.arange(lo // sd, (hi - 1) // sd + 1, dtype=np.int64)
        ids_d = self._ids(d_list)
        ppl_d = D.blocks_per_logical
        pos_d = v_abs - d_list.first_token // sd
        g = ids_d[pos_d // ppl_d] * ppl_d + pos_d % ppl_d
        J = len(v_abs)
        kind = v_abs % var.classes
        windows: list[Pieces] = list(var.interior)
        keys: list[Any] = [(c, 0, sd) for c in range(var.classes)]
        a0 = lo - int(v_abs[0]) * sd
        b1 = hi - int(v_abs[-1]) * sd
        for j, a, b in ((0, a0, sd), (J - 1, 0, b1)):
            if (a, b) != (0, sd):
                c = int(kind[j])
                windows.append(var.window(c, a, b))
                keys.append((c, a, b))
                kind[j] = len(windows) - 1
        rel_lo = min(w.rel_lo for w in windows)
        rel_hi = max(w.rel_hi for w in windows)
        ids_p = self._ids(p_list)
        ppl_p = P.blocks_per_logical
        n_pages = len(ids_p) * ppl_p
        anchor = (v_abs * sd) // sp - p_list.first_token // sp
        pos = anchor[:, None] + np.arange(rel_lo, rel_hi + 1, dtype=np.int64)[None, :]
        np.clip(pos, 0, max(n_pages - 1, 0), out=pos)
        p_ids = ids_p[pos // ppl_p] * ppl_p + pos % ppl_p if n_pages else np.zeros(pos.shape, np.int64)
        if bool(np.all(g[1:] > g[:-1])):
            units = Units(g, kind, p_ids, rel_lo)
        else:
            order = np.argsort(g, kind="stable")
            units = Units(g[order], kind[order], p_ids[order], rel_lo)
        work = _Work(var, units, windows, tuple(keys))
        if var.weights is not None:
            raw, nseg = self._linear_count(var, p_list, d_list, lo, hi, ids_p, ids_d)
            return work, raw, nseg
        counts = np.bincount(kind, minlength=len(windows)).tolist()
        raw = sum(cnt * w.raw for cnt, w in zip(counts, windows))
        nseg = sum(cnt * w.segments for cnt, w in zip(counts, windows))
        if var.collapse:
            interior = kind < var.classes  # whole-page segments (token order)
            a_ids = p_ids[:, -rel_lo] if rel_lo <= 0 <= rel_hi else np.zeros(J, np.int64)
            links = interior[1:] & interior[:-1] & (g[1:] == g[:-1] + 1) & (a_ids[1:] == a_ids[:-1] + 1)
            raw -= var.collapse * int(np.count_nonzero(links))
        return work, raw, nseg

    def _page(self, var: _AttentionCopies, p_list: BlockList, d_list: BlockList, lo: int,
              hi: int) -> tuple[_Work, int, int]:
        """:meth:`_pages` for ``[lo, hi)`` inside one D page, in Python integers."""
        P, D = self.pair.prefill, self.pair.decode
        sd, sp = var.span_d, var.span_p
        v = lo // sd
        pos = v - d_list.first_token // sd
        ppl_d = D.blocks_per_logical
        g = d_list.block_ids[pos // ppl_d] * ppl_d + pos % ppl_d
        c = v % var.classes
        a, b = lo - v * sd, hi - v * sd
        w = var.window(c, a, b)
        ppl_p = P.blocks_per_logical
        last = len(p_list.block_ids) * ppl_p - 1
        anchor = (v * sd) // sp - p_list.first_token // sp
        p_ids = []
        for r in range(w.rel_lo, w.rel_hi + 1):
            q = min(max(anchor + r, 0), max(last, 0))
            p_ids.append(p_list.block_ids[q // ppl_p] * ppl_p + q % ppl_p if last >= 0 else 0)
        units = Units(np.array([g], np.int64), np.zeros(1, np.int64), np.array([p_ids], np.int64), w.rel_lo)
        work = _Work(var, units, [w], ((c, a, b),))
        if var.weights is not None:
            raw, nseg = self._linear_count(var, p_list, d_list, lo, hi, None, None)
            return work, raw, nseg
        return work, w.raw, w.segments

    def _linear_count(self, var: _AttentionCopies, p_list: BlockList, d_list: BlockList, lo: int, hi: int,
                      ids_p: np.ndarray | None, ids_d: np.ndarray | None) -> tuple[int, int]:
        """Rows before coalescing and segments of a group with a token-outermost side: one segment
        when neither side can cut inside ``[lo, hi)``, else the reference's segments by length."""
        weights = var.weights
        if weights is None:
            raise InternalError("only token-outermost groups are counted on the listing")
        P, D = self.pair.prefill, self.pair.decode
        if not (_cuts_inside(P, var.ps, var.p_linear, p_list.first_token, lo, hi)
                or _cuts_inside(D, var.ds, var.d_linear, d_list.first_token, lo, hi)):
            dr = (lo - d_list.first_token) // D.topology.interleave % D.topology.dcp
            po = (lo - p_list.first_token) // P.topology.interleave % P.topology.dcp
            return weights.weight(hi - lo, dr, po), 1
        p_tok = _tokens(var.ps, var.p_linear, self._ids(p_list) if ids_p is None else ids_p, p_list.first_token)
        d_tok = _tokens(var.ds, var.d_linear, self._ids(d_list) if ids_d is None else ids_d, d_list.first_token)
        segs = segments(lo, hi, [p_tok, d_tok])
        return weights.rows(segs, d_tok.owner(segs.start), p_tok.owner(segs.start), var.owner_width), len(segs)

    def _zeros(self, request: Request, gi: int, d_list: BlockList, lo: int,
               hi: int) -> tuple[_Work | None, int, tuple[Note, ...]]:
        D = self.pair.decode
        z = self.zeros[gi]
        d0, d1 = d_list.token_range(D.logical_block_tokens)
        zs = max(request.prefix_hit_tokens, d0)
        if hi <= lo:
            intervals = [(zs, d1)] if zs < d1 else []
        else:
            intervals = []
            if zs < lo:
                intervals.append((zs, lo))
            if hi < d1:
                intervals.append((max(hi, zs), d1))
        if not intervals:
            return None, 0, ()
        notes = tuple(zeroed_note(self.pair, gi, z0, z1) for z0, z1 in intervals)
        sd = z.span_d
        v = intervals[0][0] // sd
        if all(z0 // sd == v and (z1 - 1) // sd == v for z0, z1 in intervals):  # one page, in Python integers
            pos = v - d_list.first_token // sd
            ppl_d = D.blocks_per_logical
            g = d_list.block_ids[pos // ppl_d] * ppl_d + pos % ppl_d
            key = tuple((z0 - v * sd, z1 - v * sd) for z0, z1 in intervals)
            w = z.window(key)
            units = Units(np.array([g], np.int64), np.zeros(1, np.int64), np.zeros((1, 0), np.int64), 0)
            raw = w.raw
            if z.linear:
                raw = 0
                for z0, z1 in intervals:
                    if _cuts_inside(D, z.ds, z.d_linear, d_list.first_token, z0, z1):
                        raw += z.count_listing(self._ids(d_list), d_list.first_token, z0, z1)
                    elif z.weights is not None:
                        dr = (z0 - d_list.first_token) // D.topology.interleave % D.topology.dcp
                        raw += z.weights.weight(z1 - z0, dr, 0)
            return _Work(z, units, [w], (key,)), raw, notes
        ppl_d = D.blocks_per_logical
        first_v = d_list.first_token // sd
        # whole pages of each interval, and the partial ones with their windows (one page may hold the
        # end of the first interval and the start of the second)
        partial: dict[int, list[tuple[int, int]]] = {}
        full: list[tuple[int, int]] = []
        for z0, z1 in intervals:
            v0, v1 = z0 // sd, (z1 - 1) // sd
            a, b = z0 - v0 * sd, z1 - v1 * sd
            if v0 == v1:
                if (a, b) != (0, sd):
                    partial.setdefault(v0, []).append((a, b))
                    continue
                full.append((v0, v0 + 1))
                continue
            f0, f1 = v0, v1 + 1
            if a:
                partial.setdefault(v0, []).append((a, sd))
                f0 += 1
            if b < sd:
                partial.setdefault(v1, []).append((0, b))
                f1 -= 1
            if f1 > f0:
                full.append((f0, f1))
        windows: list[Pieces] = [z.full]
        keys: list[Any] = [((0, sd),)]
        parts = [np.arange(f0, f1, dtype=np.int64) for f0, f1 in full]
        kinds = [np.zeros(f1 - f0, np.int64) for f0, f1 in full]
        for v, ws in partial.items():
            key = tuple(sorted(ws))
            windows.append(z.window(key))
            keys.append(key)
            parts.append(np.array([v], np.int64))
            kinds.append(np.array([len(windows) - 1], np.int64))
        v_all = np.concatenate(parts) if len(parts) > 1 else parts[0]
        kind = np.concatenate(kinds) if len(kinds) > 1 else kinds[0]
        pos_d = v_all - first_v
        ids_d = self._ids(d_list)
        gid = ids_d[pos_d // ppl_d] * ppl_d + pos_d % ppl_d
        if len(gid) > 1 and not bool(np.all(gid[1:] > gid[:-1])):
            order = np.argsort(gid, kind="stable")
            gid, kind = gid[order], kind[order]
        work = _Work(z, Units(gid, kind, np.zeros((len(gid), 0), np.int64), 0), windows, tuple(keys))
        if z.linear:
            raw = 0
            for z0, z1 in intervals:
                if _cuts_inside(D, z.ds, z.d_linear, d_list.first_token, z0, z1):
                    raw += z.count_listing(ids_d, d_list.first_token, z0, z1)
                elif z.weights is not None:
                    dr = (z0 - d_list.first_token) // D.topology.interleave % D.topology.dcp
                    raw += z.weights.weight(z1 - z0, dr, 0)
        else:
            counts = np.bincount(kind, minlength=len(windows)).tolist()
            raw = sum(cnt * w.raw for cnt, w in zip(counts, windows))
            if z.collapse:
                for z0, z1 in intervals:  # runs of whole pages inside one interval collapse
                    f0, f1 = -(-z0 // sd), z1 // sd  # whole pages [f0, f1)
                    if f1 - f0 > 1:
                        vv = np.arange(f0, f1, dtype=np.int64) - first_v
                        gg = ids_d[vv // ppl_d] * ppl_d + vv % ppl_d
                        raw -= z.collapse * int(np.count_nonzero(gg[1:] == gg[:-1] + 1))
        return work, raw, notes

    # ---- state groups ---------------------------------------------------------------------------------
    def _state(self, request: Request, gi: int, cost_model: CostModel | None) -> _Group:
        st = self.states[gi]
        paired, _ = paired_slots(request, gi)
        notes = tuple(state_notes(self.pair, request, gi))
        if not paired:
            return _Group(None, None, 0, 0, notes, (), "state")
        arr = np.array(paired, np.int64)
        order = np.argsort(arr[:, 1], kind="stable")
        units = Units(arr[order, 1], np.zeros(len(arr), np.int64), arr[order, 0:1], 0)
        work = _Work(st, units, [st.pattern], ("slot",))
        cost = 0.0
        if cost_model is not None:  # auto's total: a state group posts its coalesced rows (counted exactly, always)
            works: list[_Work | None] = [None] * len(self.pair.model.groups)
            works[gi] = work
            variants = tuple("state" if i == gi else "none" for i in range(len(works)))
            cost = cost_model.cost(sum(len(b) for b in self._blocks_of(works, variants, True, None)), 0)
        return _Group(work, None, st.per_pair * len(paired), 0, notes, (), "state", cost)

