"""The compiled planner's engine: per-stream patterns of pieces, families of streams that share a
pattern, and the expansion of a pattern over a request's units into sorted, merged plan rows.

A plan's rows are the *maximal runs* of its byte mapping, sorted by stream (docs/design.md §4.3):
a stream is one ``(d_rank, p_rank, d_region, p_region)`` key for copies, ``(d_rank, d_region)``
for zeros. Inside a stream the rows are sorted by D offset, so they follow the D *units* (kernel
pages, or state slots) in the order of their ids, and inside a unit the offsets of a pattern::

    unit (D page) of kind k, id g      pattern of kind k (one stream):  din  n   rel  pin
                                                                         0   4096  0   8192
                                                                      8192   4096  0  12288
    rows of the unit:  d_offset = g * unit_bytes_d + din,  p_offset = P unit id (anchor + rel) *
                       unit_bytes_p + pin,  nbytes = n

Streams whose patterns differ only by a constant offset on each side form a *family*; a family's
rows are one representative stream's rows plus a per-stream shift, so the per-request work is the
representative's (one unit sequence, merged once) and one broadcast per output column::

    family rows (S streams x H rows):  d_offset[s, i] = d_rep[i] + shift_d[s]   (written in place)

Merging: two neighbours merge when adjacent on both sides. Inside a unit a pattern is merged once
(pieces of the same P unit); across units, and between pieces of different P units, adjacency
depends on the request's ids, so it is checked on the representative in O(units x pieces) and
only where a pattern can ever merge (a piece ending its unit next to one starting a unit, with the
P offsets a whole number of P units apart).

Worked number: Llama-3-70B-like TP8 -> TP4 is one family of 4 D ranks x 2 P ranks x 80 layers =
640 streams; a D page's pattern per stream is 2 pieces (K and V of one head, 4096 B each) that
never merge (V ends 4096 B before the next page starts, 12288 B after K), so a 16k-token request
is 1024 pages x 2 = 2048 representative rows and 640 x 2048 = 1,310,720 plan rows.
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs
import numpy as np

from ..errors import InternalError

__all__ = ["Pieces", "StreamTable", "Family", "Units", "FamilyRows", "FlatRows", "pieces_from_rows",
           "build_families", "uniform_rep", "family_rows", "stream_rows", "flat_rows", "can_merge"]


@attrs.frozen(eq=False)
class StreamTable:
    """The streams of one group, sorted by their key (the plan's row order).

    ``keys`` is ``(S, 4)`` for copies (d_rank, p_rank, d_region, p_region) or ``(S, 2)`` for zeros
    (d_rank, d_region); ``packed`` is each key as one int64, increasing.
    """

    keys: np.ndarray
    packed: np.ndarray
    widths: tuple[int, ...]

    @classmethod
    def of(cls, keys: np.ndarray, widths: Sequence[int]) -> StreamTable:
        keys = np.asarray(keys, np.int64).reshape(-1, len(widths))
        packed = pack(keys, widths)
        order = np.unique(packed, return_index=True)[1]
        return cls(keys[order], packed[order], tuple(int(w) for w in widths))

    def __len__(self) -> int:
        return len(self.packed)

    def index(self, keys: np.ndarray) -> np.ndarray:
        """The stream index of each key row (every key must be in the table)."""
        p = pack(np.asarray(keys, np.int64).reshape(-1, len(self.widths)), self.widths)
        i = np.searchsorted(self.packed, p)
        if len(p) and (int(i.max()) >= len(self.packed) or not np.array_equal(self.packed[i], p)):
            raise InternalError("a window produced a stream the interior windows did not")
        return i


def pack(keys: np.ndarray, widths: Sequence[int]) -> np.ndarray:
    """Keys ``(n, k)`` as one int64 each, most significant column first (order preserving)."""
    out = np.zeros(len(keys), np.int64)
    for j, w in enumerate(widths):
        out = out * int(w) + keys[:, j]
    return out


@attrs.frozen(eq=False)
class Pieces:
    """The pieces of one window (a token range inside one unit) for every stream of a table, sorted
    by (stream, din) and merged where they are adjacent on both sides inside one P unit.

    CSR: stream ``s``'s pieces are ``[start[s], start[s + 1])``; ``stream`` is each piece's stream.
    ``rel`` is the P unit relative to the unit's P anchor, ``pin`` the offset inside that P unit
    (0 and ``din`` for zeros). ``inner`` says whether two neighbours of one stream inside the unit
    could still merge (D-adjacent, in different P units a whole number of P units apart: it depends
    on the P ids). ``raw`` is how many rows the reference planner emits for the window,
    ``segments`` its aligned segments.
    """

    start: np.ndarray
    stream: np.ndarray
    din: np.ndarray
    n: np.ndarray
    rel: np.ndarray
    pin: np.ndarray
    inner: bool = False
    raw: int = 0
    segments: int = 0
    rel_lo: int = 0
    rel_hi: int = 0

    def count(self, s: int) -> int:
        return int(self.start[s + 1] - self.start[s])

    def of(self, s: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        a, b = int(self.start[s]), int(self.start[s + 1])
        return self.din[a:b], self.n[a:b], self.rel[a:b], self.pin[a:b]


def pieces_from_rows(table: StreamTable, keys: np.ndarray, din: np.ndarray, n: np.ndarray, rel: np.ndarray,
                     pin: np.ndarray, *, unit_p: np.ndarray | None = None, raw: int = 0, segments: int = 0) -> Pieces:
    """Pieces from raw rows (``keys`` per row, offsets already made relative to their units);
    ``unit_p`` is the P unit bytes of each stream (None: one-sided rows, zeros).

    One-sided rows (zeros) pass ``rel`` 0 and ``pin = din``, so that D adjacency alone merges them.
    """
    s = table.index(keys)
    order = np.lexsort((din, s))
    s, din, n, rel, pin = s[order], din[order], n[order], rel[order], pin[order]
    if len(s) > 1:
        cont = (s[1:] == s[:-1]) & (rel[1:] == rel[:-1]) & (din[1:] == din[:-1] + n[:-1]) \
            & (pin[1:] == pin[:-1] + n[:-1])
        if cont.any():
            heads = np.flatnonzero(np.concatenate(([True], ~cont)))
            n = np.add.reduceat(n, heads)
            s, din, rel, pin = s[heads], din[heads], rel[heads], pin[heads]
    inner = False
    if unit_p is not None and len(s) > 1:
        up = unit_p[s[:-1]]
        gap = pin[:-1] + n[:-1] - pin[1:]
        inner = bool(np.any((s[1:] == s[:-1]) & (din[1:] == din[:-1] + n[:-1]) & (rel[1:] != rel[:-1])
                            & (gap % np.maximum(up, 1) == 0)))
    start = np.searchsorted(s, np.arange(len(table) + 1))
    rel_lo, rel_hi = (int(rel.min()), int(rel.max())) if len(rel) else (0, 0)
    return Pieces(start, s, din, n, rel, pin, inner, raw, segments, rel_lo, rel_hi)


@attrs.frozen(eq=False)
class Family:
    """Streams (indices into the table, increasing) whose patterns are the first one's plus a
    constant shift on each side, for every interior kind."""

    streams: np.ndarray
    shift_d: np.ndarray
    shift_p: np.ndarray
    unit_d: int  # bytes of one D unit of these streams' D region
    unit_p: int  # bytes of one P unit of their P region (0 for zeros)


def _signature(p: Pieces, s: int, ref: tuple[int, int]) -> bytes:
    din, n, rel, pin = p.of(s)
    return b"|".join(((din - ref[0]).tobytes(), n.tobytes(), rel.tobytes(), (pin - ref[1]).tobytes()))


def build_families(table: StreamTable, kinds: Sequence[Pieces], unit_d: np.ndarray,
                   unit_p: np.ndarray) -> list[Family]:
    """Partition the streams into families (see the module docstring); ``unit_d``/``unit_p`` are
    the unit bytes of each stream's regions. Streams without any piece are left out."""
    groups: dict[bytes, list[tuple[int, int, int]]] = {}
    for s in range(len(table)):
        ref = None
        for p in kinds:
            if p.count(s):
                a = int(p.start[s])
                ref = (int(p.din[a]), int(p.pin[a]))
                break
        if ref is None:
            continue
        sig = b"#".join([np.array([unit_d[s], unit_p[s]], np.int64).tobytes()]
                        + [_signature(p, s, ref) for p in kinds])
        groups.setdefault(sig, []).append((s, ref[0], ref[1]))
    out = []
    for members in groups.values():
        arr = np.array(members, np.int64)
        s0 = int(arr[0, 0])
        out.append(Family(arr[:, 0], arr[:, 1] - arr[0, 1], arr[:, 2] - arr[0, 2], int(unit_d[s0]), int(unit_p[s0])))
    return out


Rep = tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]  # din, n, rel, pin of the representative


def uniform_rep(p: Pieces, fam: Family) -> Rep | None:
    """The representative's pieces of window ``p`` when every stream of ``fam`` has them shifted by
    its family shift; None when the family is not uniform on this window."""
    st = p.start[fam.streams]
    counts = p.start[fam.streams + 1] - st
    m = int(counts[0])
    if np.any(counts != m):
        return None
    rep = p.of(int(fam.streams[0]))
    if m == 0 or len(fam.streams) == 1:
        return rep
    idx = st[:, None] + np.arange(m, dtype=np.int64)[None, :]
    ok = (np.array_equal(p.n[idx], np.broadcast_to(rep[1], idx.shape))
          and np.array_equal(p.rel[idx], np.broadcast_to(rep[2], idx.shape))
          and np.array_equal(p.din[idx] - fam.shift_d[:, None], np.broadcast_to(rep[0], idx.shape))
          and np.array_equal(p.pin[idx] - fam.shift_p[:, None], np.broadcast_to(rep[3], idx.shape)))
    return rep if ok else None


@attrs.frozen(eq=False)
class Units:
    """One request's units of one group, sorted by D unit id: each unit's kind (an index into the
    request's kind list) and, per relative P unit ``rel0 + k``, the P unit id (column ``k``)."""

    g: np.ndarray  # D unit ids, increasing
    kind: np.ndarray  # kind index of each unit
    p_ids: np.ndarray  # (len(g), width) P unit ids, or (len(g), 0) for zeros
    rel0: int = 0


def _expand(units: Units, reps: Sequence[Rep], unit_d: int, unit_p: int,
            two_sided: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The representative's rows over ``units`` (unmerged): D offset, P offset, bytes."""
    m = np.array([len(r[0]) for r in reps], np.int64)
    if len(reps) == 1:
        din, n, rel, pin = reps[0]
        J, k = len(units.g), len(din)
        d = (units.g[:, None] * unit_d + din[None, :]).ravel()
        nn = np.broadcast_to(n[None, :], (J, k)).ravel()
        if not two_sided:
            return d, np.zeros(0, np.int64), nn
        pid = units.p_ids[:, rel - units.rel0]  # (J, k)
        p = (pid * unit_p + pin[None, :]).ravel()
        return d, p, nn
    lengths = m[units.kind]
    k = int(lengths[0]) if len(lengths) else 0
    if k and bool(np.all(lengths == k)):  # every unit's kind has k pieces: a (units, k) table per column
        J = len(units.g)
        tab = [np.stack([r[i] if len(r[i]) == k else np.zeros(k, np.int64) for r in reps])[units.kind]
               for i in range(4)]
        d = (units.g[:, None] * unit_d + tab[0]).ravel()
        nn = tab[1].ravel()
        if not two_sided:
            return d, np.zeros(0, np.int64), nn
        p = (units.p_ids[np.arange(J, dtype=np.int64)[:, None], tab[2] - units.rel0] * unit_p + tab[3]).ravel()
        return d, p, nn
    base = np.cumsum(m) - m
    cat = [np.concatenate([r[i] for r in reps]) for i in range(4)]
    R = int(lengths.sum())
    unit_of = np.repeat(np.arange(len(units.g), dtype=np.int64), lengths)
    first = np.cumsum(lengths) - lengths
    piece = np.arange(R, dtype=np.int64) - np.repeat(first - base[units.kind], lengths)
    d = units.g[unit_of] * unit_d + cat[0][piece]
    nn = cat[1][piece]
    if not two_sided:
        return d, np.zeros(0, np.int64), nn
    p = units.p_ids[unit_of, cat[2][piece] - units.rel0] * unit_p + cat[3][piece]
    return d, p, nn


def can_merge(reps: Sequence[Rep], used: np.ndarray, unit_d: int, unit_p: int, two_sided: bool) -> bool:
    """Whether any two neighbouring rows of these kinds could ever be adjacent on both sides."""
    kinds = [reps[int(k)] for k in used if len(reps[int(k)][0])]
    for din, n, rel, pin in kinds:  # inside a unit: pieces of different P units
        if len(din) > 1:
            d_adj = din[1:] == din[:-1] + n[:-1]
            if not two_sided:
                if d_adj.any():
                    return True
                continue
            gap = pin[:-1] + n[:-1] - pin[1:]
            if np.any(d_adj & (rel[1:] != rel[:-1]) & (gap % unit_p == 0)):
                return True
    ends = [(int(r[2][-1]), int(r[3][-1] + r[1][-1])) for r in kinds if int(r[0][-1] + r[1][-1]) == unit_d]
    starts = [(int(r[2][0]), int(r[3][0])) for r in kinds if int(r[0][0]) == 0]
    if not two_sided:
        return bool(ends and starts)
    return any((pe - ps) % unit_p == 0 for _, pe in ends for _, ps in starts)


@attrs.frozen(eq=False)
class FamilyRows:
    """One family's rows for one request: the representative's merged rows (``d``, ``p``, ``n``), to
    be shifted per stream, or, when the family is not uniform on this request's windows, each
    stream's own rows (``split``: one (d, p, n) triple per stream of the family)."""

    family: Family
    d: np.ndarray
    p: np.ndarray
    n: np.ndarray
    split: tuple[tuple[np.ndarray, np.ndarray, np.ndarray], ...] | None = None

    def count(self, i: int) -> int:
        """Rows of the family's stream number ``i``."""
        if self.split is not None:
            return len(self.split[i][2])
        return len(self.n)


def _merged(d: np.ndarray, p: np.ndarray, n: np.ndarray, two_sided: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    if len(n) < 2:
        return d, p, n
    cont = d[1:] == d[:-1] + n[:-1]
    if two_sided:
        cont &= p[1:] == p[:-1] + n[:-1]
    if not cont.any():
        return d, p, n
    heads = np.flatnonzero(np.concatenate(([True], ~cont)))
    return d[heads], (p[heads] if two_sided else p), np.add.reduceat(n, heads)


def stream_rows(units: Units, reps: Sequence[Rep], unit_d: int, unit_p: int, two_sided: bool,
                merge: bool | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """One pattern's rows over ``units``, merged: (D offsets, P offsets, bytes)."""
    if not len(units.g):
        z = np.zeros(0, np.int64)
        return z, z, z
    d, p, n = _expand(units, reps, unit_d, unit_p, two_sided)
    if merge is None:
        merge = can_merge(reps, np.unique(units.kind), unit_d, unit_p, two_sided)
    if merge:
        d, p, n = _merged(d, p, n, two_sided)
    return d, p, n


def family_rows(fam: Family, units: Units, reps: Sequence[Rep] | None, windows: Sequence[Pieces],
                two_sided: bool) -> FamilyRows:
    """The rows of ``fam`` over ``units`` whose kind ``k`` is window ``windows[k]``: from the
    representative's patterns ``reps`` (:func:`uniform_rep` of every window), or stream by stream
    when ``reps`` is None (the family is not uniform on one of the windows)."""
    if reps is not None:
        d, p, n = stream_rows(units, reps, fam.unit_d, fam.unit_p, two_sided)
        return FamilyRows(fam, d, p, n)
    split = []
    for s in fam.streams.tolist():
        own = [w.of(s) for w in windows]
        split.append(stream_rows(units, own, fam.unit_d, fam.unit_p, two_sided))
    z = np.zeros(0, np.int64)
    return FamilyRows(fam, z, z, z, tuple(split))


@attrs.frozen(eq=False)
class FlatRows:
    """Rows of many streams at once, sorted by (stream, D offset) and merged: ``s`` is each row's
    stream (an index into the table the rows were built for, or into the global table).
    ``pieces``, when given, are these rows as consecutive parts (views, never joined) and the four
    arrays are empty."""

    s: np.ndarray
    d: np.ndarray
    p: np.ndarray
    n: np.ndarray
    pieces: tuple[FlatRows, ...] | None = None


def flat_rows(units: Units, windows: Sequence[Pieces], unit_d: np.ndarray, unit_p: np.ndarray,
              two_sided: bool) -> FlatRows:
    """Every stream's rows over ``units`` in one pass (no families): stream after stream, units in
    order, each unit's pieces of its kind. A fixed number of array operations whatever the number
    of streams and patterns: the path for small plans and for streams without a shared pattern."""
    S, J = len(unit_d), len(units.g)
    z = np.zeros(0, np.int64)
    if S == 0 or J == 0:
        return FlatRows(z, z, z, z)
    if J == 1:  # one unit: its window's pieces, stream after stream, as they are
        w = windows[int(units.kind[0])]
        s = w.stream
        d = units.g[0] * unit_d[s] + w.din
        if not two_sided:
            return FlatRows(s, d, d, w.n)
        p = units.p_ids[0, w.rel - units.rel0] * unit_p[s] + w.pin
        n = w.n
        if w.inner and len(n) > 1:
            cont = (s[1:] == s[:-1]) & (d[1:] == d[:-1] + n[:-1]) & (p[1:] == p[:-1] + n[:-1])
            if cont.any():
                heads = np.flatnonzero(np.concatenate(([True], ~cont)))
                s, d, p, n = s[heads], d[heads], p[heads], np.add.reduceat(n, heads)
        return FlatRows(s, d, p, n)
    counts = np.stack([np.diff(w.start) for w in windows])  # (kinds, S)
    starts = np.stack([w.start[:-1] for w in windows])
    base = np.cumsum([0] + [len(w.din) for w in windows])[:-1]
    din = np.concatenate([w.din for w in windows])
    nn = np.concatenate([w.n for w in windows])
    blk = counts[units.kind].T.ravel()  # (S, J) stream-major
    first = (starts[units.kind] + base[units.kind][:, None]).T.ravel()
    R = int(blk.sum())
    if R == 0:
        return FlatRows(z, z, z, z)
    rb = np.repeat(np.arange(S * J, dtype=np.int64), blk)
    off = np.cumsum(blk) - blk
    piece = np.arange(R, dtype=np.int64) - np.repeat(off - first, blk)
    s = rb // J
    j = rb - s * J
    d = units.g[j] * unit_d[s] + din[piece]
    n = nn[piece]
    if two_sided:
        rel = np.concatenate([w.rel for w in windows])
        pin = np.concatenate([w.pin for w in windows])
        p = units.p_ids[j, rel[piece] - units.rel0] * unit_p[s] + pin[piece]
    else:
        p = d
    if R > 1:
        cont = (s[1:] == s[:-1]) & (d[1:] == d[:-1] + n[:-1])
        if two_sided:
            cont &= p[1:] == p[:-1] + n[:-1]
        if cont.any():
            heads = np.flatnonzero(np.concatenate(([True], ~cont)))
            s, d, p, n = s[heads], d[heads], p[heads], np.add.reduceat(n, heads)
    return FlatRows(s, d, p, n)
