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

The other two axes of docs/design.md §11.1 are sliced here too: layers by pipeline stage
(:func:`layer_partition`, vLLM's ``get_pp_indices`` rule) and tokens by decode context parallel
rank (:class:`TokenShard`)::

    61 layers, pp = 4:  61 // 4 = 15 each, 1 left over -> partition -2   [15, 15, 16, 15]
    dcp = 2, interleave 4:  tokens 0-3 -> rank 0, 4-7 -> rank 1, 8-11 -> rank 0, ...
"""

from __future__ import annotations

import math

import attrs

from ..errors import GeometryError
from .ints import ceil_div

__all__ = ["Slice", "owned_slice", "local_count", "divisible", "check_divisible", "tp_suggestions", "sources",
           "SourceSlice", "layer_partition", "stage_slices", "TokenShard"]


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
    spread: int | None = None,
) -> tuple[SourceSlice, ...]:
    """Cover D rank ``d_rank``'s slice with P slices, every item read exactly once.

    An item held by several P ranks (replicas, or a replicated axis) is read from holder number
    ``spread % holders`` (``spread`` defaults to ``d_rank``) so that D ranks spread their reads
    over the P ranks. The result is ordered by item, then by P rank, and covers the D slice
    exactly. With topologies (docs/design.md §11.3) ``p_tp``/``d_tp`` count head groups and
    ``spread`` is derived from the flat D rank.

    >>> [(s.p_rank, str(s.items)) for s in sources(8, p_tp=8, p_replicated=False,
    ...                                            d_tp=4, d_rank=1, d_replicated=False)]
    [(2, '[2, 3)'), (3, '[3, 4)')]
    """
    want = owned_slice(n, d_tp, d_rank, replicated=d_replicated)
    key = d_rank if spread is None else spread
    if p_replicated:
        return (SourceSlice(key % p_tp, want),)
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
        out.append(SourceSlice(item * reps + key % reps, Slice(item, item + 1)))
    return tuple(out)


def layer_partition(num_layers: int, pp: int, counts: tuple[int, ...] | None = None) -> tuple[int, ...]:
    """Layers per pipeline stage: ``counts`` when given (checked), else vLLM's default rule.

    vLLM (``vllm/distributed/utils.py``, ``get_pp_indices``) gives every stage ``L // pp`` layers
    and the ``L % pp`` left over one each to partitions ``-2, -3, ...``: never the last stage, which
    also runs the final norm and the LM head. ``counts`` plays ``VLLM_PP_LAYER_PARTITION``.

    >>> layer_partition(80, 2), layer_partition(61, 4), layer_partition(7, 4)
    ((40, 40), (15, 15, 16, 15), (2, 2, 2, 1))
    """
    if pp < 1 or num_layers < pp:
        raise GeometryError("topology.pp", f"{pp} pipeline stages for {num_layers} layers", actual=pp,
                            expected=f"1 <= pp <= {num_layers}",
                            fix="every stage needs at least one layer (vLLM: pp cannot exceed the layers)")
    if counts is not None:
        if len(counts) != pp or any(c < 1 for c in counts) or sum(counts) != num_layers:
            raise GeometryError("topology.partition", f"{list(counts)} is not {pp} stage sizes >= 1 summing to "
                                f"{num_layers} layers", actual=tuple(counts),
                                expected=f"{pp} counts >= 1, sum {num_layers}",
                                fix="give one layer count per stage, like VLLM_PP_LAYER_PARTITION, or omit it")
        return tuple(int(c) for c in counts)
    out = [num_layers // pp] * pp
    for i in range(2, num_layers % pp + 2):
        out[-i] += 1
    return tuple(out)


def stage_slices(counts: tuple[int, ...]) -> tuple[Slice, ...]:
    """Global layer range of each stage: ``[sum(counts[:s]), sum(counts[:s+1]))``.

    >>> [str(s) for s in stage_slices((15, 15, 16, 15))]
    ['[0, 15)', '[15, 30)', '[30, 46)', '[46, 61)']
    """
    out, start = [], 0
    for c in counts:
        out.append(Slice(start, start + c))
        start += c
    return tuple(out)


@attrs.frozen
class TokenShard:
    """The tokens a decode-context-parallel rank holds: ``(t // interleave) % size == rank``.

    ``size`` 1 (no DCP) holds every token. docs/design.md §11.2 gives the slot of an owned token.

    >>> TokenShard(2, 4, 1).owner(6), TokenShard(2, 4, 1).holds(6), str(TokenShard())
    (1, True, 'all')
    """

    size: int = 1
    interleave: int = 1
    rank: int = 0

    def owner(self, token: int) -> int:
        """The dcp rank that holds ``token``."""
        return (token // self.interleave) % self.size

    def holds(self, token: int) -> bool:
        return self.owner(token) == self.rank

    @property
    def all(self) -> bool:
        return self.size == 1

    def meets(self, other: TokenShard) -> bool:
        """Whether some token is held by both shards (O(1)).

        A shard holds ``t`` exactly when ``t mod (size * interleave)`` lies in ``[rank * interleave,
        (rank + 1) * interleave)``. Residues ``x`` mod ``A`` and ``y`` mod ``B`` belong to one token
        exactly when ``x = y (mod gcd(A, B))``, so the shards meet when the differences ``x - y`` of
        the two windows, an interval, hold a multiple of the gcd.

        >>> TokenShard(4, 1, 1).meets(TokenShard(2, 1, 1)), TokenShard(4, 1, 2).meets(TokenShard(2, 1, 1))
        (True, False)
        """
        a_period, b_period = self.size * self.interleave, other.size * other.interleave
        g = math.gcd(a_period, b_period)
        lo = self.rank * self.interleave - (other.rank * other.interleave + other.interleave - 1)
        hi = self.rank * self.interleave + self.interleave - 1 - other.rank * other.interleave
        return hi // g * g >= lo

    def __str__(self) -> str:
        if self.size == 1:
            return "all"
        chunk = "t" if self.interleave == 1 else f"t // {self.interleave}"
        return f"{chunk} % {self.size} == {self.rank}"
