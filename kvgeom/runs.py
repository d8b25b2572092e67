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

__all__ = ["Mode", "fold_modes", "strided_rows"]

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
