"""Accumulate plan rows as column chunks and concatenate each column once (planner internals)."""

from __future__ import annotations

import numpy as np

from ..values.plan import Copies, Zeros

__all__ = ["Rows"]

Chunk = tuple[int, "int | np.ndarray"]  # (rows, a scalar for all of them or one value per row)


class Rows:
    """Column chunks of copy (or zero) rows, concatenated once at the end.

    Scalars are kept as scalars until :meth:`column`, which expands a column of scalars with one
    ``np.repeat`` instead of one array per chunk (plans of state groups add hundreds of chunks).
    """

    def __init__(self) -> None:
        self.cols: list[list[Chunk]] = [[] for _ in range(7)]
        self.count = 0

    def add(self, p_rank: int | np.ndarray, p_region: int | np.ndarray, p_offset: int | np.ndarray,
            d_rank: int | np.ndarray, d_region: int | np.ndarray, d_offset: np.ndarray,
            nbytes: int | np.ndarray) -> None:
        """Append ``len(d_offset)`` rows; scalar arguments hold for all of them."""
        n = len(d_offset)
        if n == 0:
            return
        self.count += n
        for col, v in zip(self.cols, (p_rank, p_region, p_offset, d_rank, d_region, d_offset, nbytes)):
            col.append((n, v if isinstance(v, np.ndarray) and v.ndim else int(v)))

    def column(self, i: int) -> np.ndarray:
        chunks = self.cols[i]
        if not chunks:
            return np.zeros(0, np.int64)
        if all(isinstance(v, int) for _, v in chunks):
            return np.repeat(np.array([v for _, v in chunks], np.int64), [n for n, _ in chunks])
        if len(chunks) == 1:
            return np.asarray(chunks[0][1], np.int64)
        return np.concatenate([np.full(n, v, np.int64) if isinstance(v, int) else np.asarray(v, np.int64)
                               for n, v in chunks])

    def copies(self) -> Copies:
        return Copies(*(self.column(i) for i in range(7)))

    def zeros(self) -> Zeros:
        return Zeros(*(self.column(i) for i in (3, 4, 5, 6)))
