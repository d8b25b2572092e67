"""The chunks of a packed plan (docs/design.md §12.3): what one token of one layer costs on each rank
in staging bytes (:class:`_Planner`), the smallest capacity that plans (:func:`min_staging_bytes`),
and the cutting of each group's token range and layers into pieces that fit the staging capacity
on every rank, with each rank pair's bytes per piece.
"""

from __future__ import annotations

import numpy as np

from ..errors import InternalError, StagingCapacityError
from ..values.fields import check_int
from ..values.pair import CheckedEngines
from ..values.request import BlockList, Request
from ..values.staging import ChunkPiece
from .packed_pairs import _Group, _groups, _overlap, _Slice
from .packed_tokens import _Cuts, _cuts, _token_map, _TokenMap
from .sides import SideView

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

    def __init__(self, pair: CheckedEngines, request: Request) -> None:
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


def min_staging_bytes(pair: CheckedEngines, request: Request) -> int:
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


def _pair_bytes(pl: _Planner, g: _Group, piece: ChunkPiece, s: _Slice, section: int = 0) -> int:
    l0, l1 = _overlap(s, piece)
    if l1 <= l0:
        return 0
    if g.attention:
        return (l1 - l0) * pl.tokens(g, s, piece.token_start, piece.token_stop) * s.n * g.unit
    return (l1 - l0) * s.n * g.section_bytes[section]


def _layout(pair: CheckedEngines, request: Request, staging_bytes: int
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

