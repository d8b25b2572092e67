"""Tensor-parallel ownership as slices of a global axis, and the choice of source ranks.

Pure integer arithmetic, no arrays. One rule covers every TP pair:

    global axis (e.g. 8 KV heads)      0 1 2 3 4 5 6 7
    T = 4  (T <= N: a slice each)      [r0][r1][r2][r3]        rank r holds [r*N/T, (r+1)*N/T)
    T = 16 (T > N: replicas)           r0,r1 -> 0; r2,r3 -> 1 ...  rank r holds item r*N//T
    replicated (MLA, B/C...)           every rank holds [0, N)

Worked number: N = 8 heads, T = 4, rank 3 holds heads [3*8/4, 4*8/4) = [6, 8).

The bytes that move between a P rank and a D rank are the intersection of their slices;
:func:`sources` picks, for every item a D rank holds, exactly one P rank that holds it, spreading
replicated items over their holders by D rank.
"""

from __future__ import annotations

import math

import attrs

from ..errors import GeometryError
from .ints import ceil_div

__all__ = ["Slice", "owned_slice", "local_count", "divisible", "check_divisible", "tp_suggestions", "sources",
           "SourceSlice"]


@attrs.frozen
class Slice:
    """Half-open range ``[start, stop)`` of a global axis."""

    start: int
    stop: int

    @property
    def size(self) -> int:
        return self.stop - self.start

    def intersect(self, other: Slice) -> Slice | None:
        lo, hi = max(self.start, other.start), min(self.stop, other.stop)
        return Slice(lo, hi) if lo < hi else None

    def __str__(self) -> str:
        return f"[{self.start}, {self.stop})"


def divisible(n: int, tp: int, *, replicated: bool = False) -> bool:
    """Whether an axis of ``n`` items can be split over ``tp`` ranks (the one TP divisibility rule).

    Accepted: replicated axes, ``n % tp == 0`` (slices) and ``tp % n == 0`` (replicas).

    >>> divisible(8, 4), divisible(2, 8), divisible(8, 3)
    (True, True, False)
    """
    return replicated or n % tp == 0 or tp % n == 0


def tp_suggestions(n: int, tp: int, count: int = 6) -> list[int]:
    """A few TP sizes that fit an axis of ``n`` items, nearest ``tp`` first, in bounded work.

    The largest divisor of ``n`` not above ``tp`` (``gcd(n, tp)`` is one: not always the largest,
    but always found in O(log)), the smallest multiple of ``n`` not below ``tp``, and the divisors and
    multiples among the small powers of two. Never enumerates a range whose length comes from
    ``n`` or ``tp`` (they may be a hostile 2**47).

    >>> tp_suggestions(8, 3), tp_suggestions(2**47 + 1, 2)
    ([1, 2, 4, 8, 16, 32], [1, 140737488355329])
    """
    picks = {math.gcd(n, tp), ceil_div(tp, n) * n}
    picks.update(t for t in (1 << k for k in range(11)) if n % t == 0 or t % n == 0)
    return sorted(sorted(picks, key=lambda t: (abs(t - tp), t))[:count])


def check_divisible(path: str, n: int, tp: int, *, replicated: bool = False) -> None:
    """Raise :class:`GeometryError` when an axis of ``n`` items cannot be split over ``tp`` ranks
    (:func:`divisible`). The fix names a few TP sizes that fit (:func:`tp_suggestions`)."""
    if divisible(n, tp, replicated=replicated):
        return
    raise GeometryError(
        path,
        f"{n} items cannot be sharded over tp={tp}: {tp} neither divides {n} nor is a multiple of it",
        actual=(n, tp),
        expected=f"tp dividing {n} or a multiple of {n}",
        fix=f"use tp in {tp_suggestions(n, tp)}... or make the axis replicated",
    )


def owned_slice(n: int, tp: int, rank: int, *, replicated: bool = False) -> Slice:
    """The items of a global axis of ``n`` items that rank ``rank`` of ``tp`` holds.

    >>> owned_slice(8, 4, 3)
    Slice(start=6, stop=8)
    >>> owned_slice(2, 8, 5)          # 8 ranks over 2 heads: ranks 4..7 hold head 1
    Slice(start=1, stop=2)
    """
    if n < 1 or tp < 1:
        raise GeometryError("owned_slice", f"an axis of {n} items over tp={tp}", actual=(n, tp),
                            expected="n >= 1 and tp >= 1", fix="describe at least one item and one rank")
    if not 0 <= rank < tp:
        raise GeometryError(
            "rank", f"rank {rank} is outside tp={tp}", actual=rank, expected=f"0 <= rank < {tp}"
        )
    if replicated:
        return Slice(0, n)
    check_divisible("tp", n, tp)
    if tp <= n:
        per = n // tp
        return Slice(rank * per, (rank + 1) * per)
    item = rank * n // tp
    return Slice(item, item + 1)


def local_count(n: int, tp: int, *, replicated: bool = False) -> int:
    """How many items of the axis every rank holds (equal on all ranks)."""
    return owned_slice(n, tp, 0, replicated=replicated).size


@attrs.frozen
class SourceSlice:
    """Items ``items`` of the global axis that D rank reads from P rank ``p_rank``."""

    p_rank: int
    items: Slice


def sources(
    n: int,
    *,
    p_tp: int,
    p_replicated: bool,
    d_tp: int,
    d_rank: int,
    d_replicated: bool,
) -> tuple[SourceSlice, ...]:
    """Cover D rank ``d_rank``'s slice with P slices, every item read exactly once.

    An item held by several P ranks (replicas, or a replicated axis) is read from holder number
    ``d_rank % holders`` so that D ranks spread their reads over the P ranks. The result is
    ordered by item, then by P rank, and covers the D slice exactly.

    >>> [(s.p_rank, str(s.items)) for s in sources(8, p_tp=8, p_replicated=False,
    ...                                            d_tp=4, d_rank=1, d_replicated=False)]
    [(2, '[2, 3)'), (3, '[3, 4)')]
    """
    want = owned_slice(n, d_tp, d_rank, replicated=d_replicated)
    if p_replicated:
        return (SourceSlice(d_rank % p_tp, want),)
    out: list[SourceSlice] = []
    if p_tp <= n:
        for p in range(p_tp):
            got = owned_slice(n, p_tp, p).intersect(want)
            if got is not None:
                out.append(SourceSlice(p, got))
        return tuple(out)
    # p_tp > n: item i is held by ranks [i*p_tp/n, (i+1)*p_tp/n)
    reps = p_tp // n
    for item in range(want.start, want.stop):
        out.append(SourceSlice(item * reps + d_rank % reps, Slice(item, item + 1)))
    return tuple(out)
