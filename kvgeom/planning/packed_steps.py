"""The staging steps of a packed plan (docs/design.md §12.1, §12.2): :class:`_Builder` lays out one piece of
a chunk in each rank's staging slot, rank pair after rank pair by page bytes, and writes its pack
steps on P, the wire copies between the slots, and its unpack steps on D.

A group with a per-plane layout on either side (docs/design.md §3.5) is laid out plane by plane:
each (layer, plane) is a layer entry, and a D block (the pair's tokens of one D page, or of one
affine piece of it) holds (head, token, head-vector byte modes) packed densely in D's order of
those modes' strides. For CPU_ATTN ``vec`` K (D block 64, 2 heads of 128 float32 elements) that
order is head, element, token, byte: a full D page's K unpacks as one 32,768-byte element per
head, and a P page of 32 tokens packs its K as ``2 x 128`` elements of ``32 * 4 = 128`` bytes.
"""

from __future__ import annotations

import numpy as np

from ..arith.runs import Mode, dense_strides, fold_modes
from ..errors import InternalError
from ..values.layout import StateGroupGeometry
from ..values.model import AttentionSpec, StateSpec
from ..values.staging import ChunkPiece, StagingStep
from .attention import vector_unit
from .packed_chunks import _Planner
from .packed_pairs import _by_page_bytes, _Group, _overlap, _Slice, _state_pair_sections
from .packed_tokens import _TokenMap
from .sides import SideView


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
        if ps.per_plane or ds.per_plane:
            self._attention_planes(chunk, g.index, spec, l0, l1, tm, s, ps, ds, p_base, d_base)
            return
        hb, planes = spec.head_bytes, spec.planes
        dl, pl = ds.plain(), ps.plain()
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

    def _plane_entries(self, side: str, view: SideView, g: int, layers: range, plane: int,
                       head0: int) -> tuple[np.ndarray, np.ndarray]:
        """(region, offset of the pair's first head on ``plane``) of every layer in ``layers``."""
        key = (f"{side}-plane{plane}-{head0}", g, layers.start, layers.stop)
        if key not in self._entries:
            reg, off = view.layer_arrays(plane)
            sel = slice(layers.start, layers.stop)
            self._entries[key] = (reg[sel], off[sel] + view.head_offset(head0, plane))
        return self._entries[key]

    def _attention_planes(self, chunk: int, g: int, spec: AttentionSpec, l0: int, l1: int, tm: _TokenMap, s: _Slice,
                          ps: SideView, ds: SideView, p_base: int, d_base: int) -> None:
        """:meth:`attention` when a side's layout is per plane (docs/design.md §3.5, §12.2): per
        plane, layer entries ``(layer, plane)`` staged at ``layer * e_layer + plane * e_plane``, and
        each D block the modes (head, token, the two sides' common byte modes) packed densely in
        D's order of their strides (outermost first)."""
        hb = spec.head_bytes
        e_plane = s.n * tm.tokens * hb  # one plane of one layer of the piece
        e_layer = spec.planes * e_plane
        layers = range(l0, l1)
        lam = np.arange(len(layers), dtype=np.int64)
        token = s.n * hb  # staging bytes of one token of the pair on one plane
        for plane in range(spec.planes):
            unit, vmodes = vector_unit(spec, [ps, ds], plane)  # innermost last: [(extent, (P stride, D stride))]
            # D's order of (head, token, byte modes): outermost first by D stride; dense strides per block size
            keyed = [(ds.head_stride(plane), 0), (ds.token_stride(plane), 1)] + [
                (st[1], 2 + k) for k, (_, st) in enumerate(vmodes)]
            order = [m for _, m in sorted(keyed, key=lambda x: (-x[0], x[1]))]

            def dense(nj: int, vmodes: list[Mode] = vmodes, order: list[int] = order, unit: int = unit
                      ) -> tuple[int, ...]:
                return dense_strides((s.n, nj) + tuple(e for e, _ in vmodes), order, unit)

            staged = lam * e_layer + plane * e_plane
            for side, view, base, head0, classes in (("decode", ds, d_base, s.d0, tm.unpack),
                                                     ("prefill", ps, p_base, s.p0, tm.pack)):
                k = 0 if side == "prefill" else 1  # the side's stride in vmodes
                reg, off = self._plane_entries(side, view, g, layers, plane, head0)
                hs, ts = view.head_stride(plane), view.token_stride(plane)
                for slot, n, count, step, nj, pages, before, tau in classes:
                    st = dense(nj)
                    modes: list[Mode] = []
                    for m in order:
                        if m == 0:
                            modes.append((s.n, (hs, st[0])))
                        elif m == 1:
                            modes += [(count, (step * ts, n * st[1])), (n, (ts, st[1]))]
                        else:
                            e, strides = vmodes[m - 2]
                            modes.append((e, (strides[k], st[m])))
                    at = off + int(view.slot_offset(np.asarray(slot, np.int64), plane))
                    self._add(side, chunk, s, reg, at, base + staged, pages, before * token + tau * st[1], modes, unit)

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

