"""Integer helpers every layer shares: the size bound and exact ceiling division.

kvgeom's geometry is integer arithmetic only (never float division): byte offsets, strides and
counts are Python ints or int64 arrays. Every size an engine or a request describes is bounded by
:data:`MAX_INT` so that sums and products of a few of them stay inside int64.

Worked number: ``ceil_div(50, 16) == 4``: 50 tokens fill four 16-token blocks (the last one
holds 2 tokens).
"""

from __future__ import annotations

__all__ = ["MAX_INT", "ceil_div"]

MAX_INT = 1 << 48  # 256 TiB: every size, stride, offset, count and id must fit well inside int64 arithmetic


def ceil_div(a: int, b: int) -> int:
    """``ceil(a / b)`` for ints, exactly (no float); ``b`` must be positive."""
    return -(-a // b)
