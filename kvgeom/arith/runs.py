"""Contiguous runs of a strided copy: the layout ``coalesce`` of CuTe, applied to both sides at once.

A copy of a block of coordinates is described per side by a base offset and, for every mode
(token, head, plane, row, channel...), its size and byte stride; the innermost unit (a head
vector, a state unit) is contiguous. Modes whose stride equals the run built so far *on every
side* fold into the run; the others are enumerated, one row per index::

    unit 256 B, token mode (16, stride 256 | 256), head mode (2, stride 4096 | 512)
    run = 256 -> token folds (256 == 256 on both sides): run = 4096
              -> head: P stride 4096 == run but D stride 512 != run: enumerated
    => 2 rows of 4096 B per base: P at base_p + {0, 4096}, D at base_d + {0, 512}

Worked number above: HND P page (head stride 16 * 256 = 4096) to NHD D page (head stride 256,
token stride 2 * 256 = 512): the token mode does not fold on D (512 != 256), so it is really
2 * 16 = 32 rows of 256 B. The function finds that by the same rule.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

__all__ = ["Mode", "common_modes", "fold_modes", "strided_rows", "run_bases", "run_offsets", "element_offsets", "dense_strides",
           "affine_runs"]

Mode = tuple[int, Sequence[int]]  # (size, stride on each side)


def fold_modes(unit_bytes: int, modes: Sequence[Mode]) -> tuple[int, list[Mode]]:
    """Fold every mode whose stride equals the current run on all sides; return (run, rest).

    Size-1 modes always fold. The order of the remaining modes is kept (outermost first in the
    enumeration that :func:`strided_rows` produces).
    """
    run = unit_bytes
    folded = [False] * len(modes)
    changed = True
    while changed:
        changed = False
        for i, (size, strides) in enumerate(modes):
            if folded[i]:
                continue
            if size == 1 or all(s == run for s in strides):
                folded[i] = True
                run *= size
                changed = True
    return run, [m for m, f in zip(modes, folded) if not f and m[0] != 1]


def common_modes(sides: Sequence[Sequence[tuple[int, int]]], total: int) -> list[Mode] | None:
    """One axis of ``total`` indices said as modes on several sides at once: the common refinement of
    each side's ``(extent, stride)`` modes (innermost first; none: ``(total, 1)``), as
    ``[(extent, (stride on each side))]`` innermost first; ``None`` when they have none (the
    sides' partial products do not divide one another).

    Used for a head vector's bytes (docs/design.md §3.5): P's contiguous 512 bytes and D's
    ``(4, 1), (128, 256)`` refine to ``(4, (1, 1)), (128, (4, 256))``.

    >>> common_modes([[], [(4, 1), (128, 256)]], 512)
    [(4, (1, 1)), (128, (4, 256))]
    >>> common_modes([[(2, 1), (3, 10)], [(3, 1), (2, 10)]], 6) is None
    True
    """
    if total == 1:
        return [(1, tuple(1 for _ in sides))]
    norm = [_coalesce([(e, s) for e, s in (m or [(total, 1)]) if e > 1]) for m in sides]
    cuts = {total}
    for modes in norm:
        acc = 1
        for e, _ in modes:
            acc *= e
            cuts.add(acc)
        if acc != total:
            return None
    chain = sorted(cuts)
    prev = 1
    for c in chain:
        if c % prev:
            return None
        prev = c
    refined: list[list[int]] = []
    for modes in norm:
        strides: list[int] = []
        acc, k = 1, 0
        for e, s in modes:  # mode (e, s) covers products [acc, acc * e); split it at the chain's cuts inside
            end = acc * e
            while k < len(chain) and chain[k] <= end:
                lo = chain[k - 1] if k else 1
                strides.append(s * (lo // acc))
                k += 1
            acc = end
        refined.append(strides)
    extents = [c // (chain[k - 1] if k else 1) for k, c in enumerate(chain)]
    return [(n, tuple(r[k] for r in refined)) for k, n in enumerate(extents)]


def _coalesce(modes: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Merge each mode into the one before it when it continues it (stride = extent x stride before)."""
    out: list[tuple[int, int]] = []
    for e, s in modes:
        if out and s == out[-1][0] * out[-1][1]:
            out[-1] = (out[-1][0] * e, out[-1][1])
        else:
            out.append((e, s))
    return out


def strided_rows(
    unit_bytes: int, modes: Sequence[Mode], bases: Sequence[np.ndarray]
) -> tuple[list[np.ndarray], int, int]:
    """Rows (one offset array per side) covering ``bases`` x every index of the unfolded modes.

    Returns ``(offsets per side, run bytes, rows per base)``. Row order: base outer, then the
    unfolded modes in the given order (first mode outermost). Every row moves ``run`` bytes.
    """
    run, rest = fold_modes(unit_bytes, modes)
    n_sides = len(bases)
    grids = [np.zeros(1, np.int64) for _ in range(n_sides)]
    for size, strides in rest:
        steps = np.arange(size, dtype=np.int64)
        grids = [(g[:, None] + steps[None, :] * strides[k]).ravel() for k, g in enumerate(grids)]
    per_base = len(grids[0])
    out = [(np.asarray(b, np.int64)[:, None] + grids[k][None, :]).ravel() for k, b in enumerate(bases)]
    return out, run, per_base


def run_bases(starts: np.ndarray, counts: np.ndarray) -> tuple[np.ndarray, int]:
    """``(base, total)`` with ``repeat(base, counts) + arange(total)`` = every ``arange(s, s + n)`` in turn.

    The form an on-device expansion takes (``repeat_interleave`` + ``arange``); :func:`run_offsets`
    is the same expansion on the host.

    >>> run_bases(np.array([10, 40]), np.array([2, 3]))   # rows 10, 11 then 40, 41, 42
    (array([10, 38]), 5)
    """
    starts = np.asarray(starts, dtype=np.int64)
    counts = np.asarray(counts, dtype=np.int64)
    before = np.cumsum(counts) - counts
    return starts - before, int(counts.sum())


def run_offsets(starts: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """Concatenation of ``arange(s, s + n)`` for every ``(s, n)`` (int64).

    >>> run_offsets(np.array([10, 40]), np.array([2, 3])).tolist()
    [10, 11, 40, 41, 42]
    """
    base, total = run_bases(starts, counts)
    return np.repeat(base, np.asarray(counts, dtype=np.int64)) + np.arange(total, dtype=np.int64)


def element_offsets(shape: Sequence[int], strides: Sequence[int], offset: int = 0) -> np.ndarray:
    """Byte offset of every element of a strided pattern, first mode outermost (int64).

    >>> element_offsets((2, 3), (100, 8), 4).tolist()
    [4, 12, 20, 104, 112, 120]
    """
    off = np.array([offset], dtype=np.int64)
    for n, s in zip(shape, strides, strict=True):
        off = (off[:, None] + np.arange(n, dtype=np.int64) * s).ravel()
    return off


def dense_strides(sizes: Sequence[int], order: Sequence[int], unit_bytes: int) -> tuple[int, ...]:
    """Byte strides that pack modes of ``sizes`` densely, ``order`` listing mode indices outermost
    first; the innermost mode steps by ``unit_bytes``. Returned in the modes' own order.

    >>> dense_strides((2, 3, 4), (1, 0, 2), 8)   # mode 1 outermost, then 0, then 2 (innermost)
    (32, 64, 8)
    """
    strides = [0] * len(sizes)
    step = unit_bytes
    for m in reversed(order):
        strides[m] = step
        step *= sizes[m]
    return tuple(strides)


def affine_runs(a: np.ndarray, b: np.ndarray, step_a: int) -> tuple[np.ndarray, np.ndarray]:
    """Cut two equal-length int64 sequences into runs where ``a`` steps by ``step_a`` and ``b`` by one
    constant per run, greedily from the left: ``(first index of each run, its length)``.

    >>> affine_runs(np.array([4, 5, 6, 9]), np.array([0, 10, 20, 30]), 1)
    (array([0, 3]), array([3, 1]))
    """
    a = np.asarray(a, dtype=np.int64)
    b = np.asarray(b, dtype=np.int64)
    n = len(a)
    if n <= 1:
        return np.zeros(n, np.int64), np.ones(n, np.int64)
    da, db = np.diff(a), np.diff(b)
    if np.all(da == step_a) and np.all(db == db[0]):
        return np.zeros(1, np.int64), np.array([n], np.int64)
    firsts = [0]
    i = 0
    while i < n - 1:
        if da[i] != step_a:  # i ends a run of its own; the next run starts at i + 1
            i += 1
            firsts.append(i)
            continue
        step_b = db[i]
        j = i + 1  # index i + 1 joins the run
        while j < n - 1 and da[j] == step_a and db[j] == step_b:
            j += 1
        i = j + 1  # j is the run's last index
        if i < n:
            firsts.append(i)
    first = np.array(firsts, np.int64)
    return first, np.diff(np.append(first, n))
