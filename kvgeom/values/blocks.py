"""Copy rows as outer sums: the compiled planner's rows of one rank before they become columns.

A family of streams shares one pattern of rows shifted per stream (docs/design.md §13), so its rows
are ``S x H`` values built from ``S + H`` numbers::

    row (s, i):  P rank p_rank[s], region p_region[s], offset p_base[i] + p_shift[s]
              -> D rank d_rank[s], region d_region[s], offset d_base[i] + d_shift[s], nbytes[i] bytes

A block with one base row (``H == 1``) may give one size per stream instead (``nbytes`` of length
``S``): that is any list of rows. :func:`kvgeom.lowering.tile_index_blocks` turns blocks straight into
the index lists of prepared descriptor tables, never writing the seven byte columns.

Worked number: 640 streams (4 D ranks x 2 P ranks x 80 layers) of 2 rows per page over 1024 pages
are one block of ``640 x 2048`` rows, described by ``6 * 640 + 3 * 2048 = 9,984`` integers.
"""

from __future__ import annotations

import attrs
import numpy as np

from .plan import Copies

__all__ = ["CopyBlock", "blocks_to_copies"]


@attrs.frozen(eq=False)
class CopyBlock:
    """``S x H`` copy rows (see the module docstring), stream-major."""

    p_rank: np.ndarray
    p_region: np.ndarray
    p_shift: np.ndarray
    d_rank: np.ndarray
    d_region: np.ndarray
    d_shift: np.ndarray
    p_base: np.ndarray
    d_base: np.ndarray
    nbytes: np.ndarray

    @property
    def streams(self) -> int:
        return len(self.d_shift)

    @property
    def per_stream(self) -> int:
        return len(self.d_base)

    def __len__(self) -> int:
        return self.streams * self.per_stream

    def row_bytes(self) -> np.ndarray:
        """Bytes of every row, stream-major."""
        if len(self.nbytes) == self.per_stream:
            return np.tile(self.nbytes, self.streams)
        return np.asarray(self.nbytes, np.int64)

    def copies(self) -> Copies:
        """The block's rows as plan columns (stream-major)."""
        S, H = self.streams, self.per_stream
        rep = np.repeat
        return Copies(rep(self.p_rank, H), rep(self.p_region, H), (self.p_shift[:, None] + self.p_base[None, :]).ravel(),
                      rep(self.d_rank, H), rep(self.d_region, H), (self.d_shift[:, None] + self.d_base[None, :]).ravel(),
                      self.row_bytes() if S * H else np.zeros(0, np.int64))


def blocks_to_copies(blocks: tuple[CopyBlock, ...] | list[CopyBlock]) -> Copies:
    """Every block's rows, in block order."""
    parts = [b.copies() for b in blocks if len(b)]
    return Copies.concat(parts) if parts else Copies.empty()
