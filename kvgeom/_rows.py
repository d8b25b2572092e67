"""Accumulate plan rows as column chunks and concatenate each column once (planner internals)."""

from __future__ import annotations

import numpy as np

from .plan import Copies, Zeros

__all__ = ["Rows"]


class Rows:
    """Column chunks of copy (or zero) rows, concatenated once at the end."""

    def __init__(self) -> None:
        self.cols: list[list[np.ndarray]] = [[] for _ in range(7)]
        self.count = 0

    def add(self, p_rank: int | np.ndarray, p_region: int | np.ndarray, p_offset: int | np.ndarray,
            d_rank: int | np.ndarray, d_region: int | np.ndarray, d_offset: np.ndarray,
            nbytes: int | np.ndarray) -> None:
        """Append rows; scalars broadcast to the length of ``d_offset``."""
        n = len(d_offset)
        if n == 0:
            return
        self.count += n
        for col, v in zip(self.cols, (p_rank, p_region, p_offset, d_rank, d_region, d_offset, nbytes)):
            col.append(np.broadcast_to(np.asarray(v, np.int64), (n,)))

    def column(self, i: int) -> np.ndarray:
        return np.concatenate(self.cols[i]) if self.cols[i] else np.zeros(0, np.int64)

    def copies(self) -> Copies:
        return Copies(*(self.column(i) for i in range(7)))

    def zeros(self) -> Zeros:
        return Zeros(*(self.column(i) for i in (3, 4, 5, 6)))
