"""Integer helpers every layer shares: the size bound, exact ceiling division, checked products.

kvgeom's geometry is integer arithmetic only (never float division): byte offsets, strides and
counts are Python ints or int64 arrays. Every size an engine or a request describes is bounded by
:data:`MAX_INT` (2**48), and so is every size *product* that becomes an int64 offset: a region's
bytes (``num_pages * page_bytes``), a logical block's tokens (``K * ppl``), a rearrange's element
bytes. :func:`checked_product` forms such a product in Python ints and refuses it, with a typed
error, before it can wrap in int64::

    Region(2**17, 2**48)      2**17 * 2**48 = 2**65 > MAX_INT   -> GeometryError (was: int64 wraps,
                                                                    page 65537 planned at offset 2**48)
    any offset inside a region  < MAX_INT,  offset + nbytes < 2 * MAX_INT  << INT64_MAX = 2**63 - 1

Worked number: ``ceil_div(50, 16) == 4``: 50 tokens fill four 16-token blocks (the last one
holds 2 tokens); ``checked_product("Region.nbytes", 9000, 2**20) == 9437184000``.
"""

from __future__ import annotations

from ..errors import GeometryError, KvGeomError, value_text

__all__ = ["MAX_INT", "INT64_MAX", "ceil_div", "checked_product"]

MAX_INT = 1 << 48  # 256 TiB: every size, stride, offset, count and id must fit well inside int64 arithmetic
INT64_MAX = (1 << 63) - 1  # the largest value of the int64 columns plans are made of


def ceil_div(a: int, b: int) -> int:
    """``ceil(a / b)`` for ints, exactly (no float); ``b`` must be positive."""
    return -(-a // b)


def checked_product(path: str, *factors: int, limit: int = MAX_INT, what: str = "product",
                    error: type[KvGeomError] = GeometryError, fix: str = "") -> int:
    """The product of ``factors`` (Python ints, so it never wraps), or ``error`` at ``path`` when it
    exceeds ``limit`` (default :data:`MAX_INT`, far inside int64).

    >>> checked_product("Region.nbytes", 4, 8192)
    32768
    """
    out = 1
    for f in factors:
        out *= int(f)
    if out > limit:
        shown = " x ".join(value_text(int(f)) for f in factors)
        raise error(path, f"the {what} {shown} = {value_text(out)} exceeds {value_text(limit)}",
                    actual=out, expected=f"<= {limit}",
                    fix=fix or "describe real sizes (kvgeom refuses products beyond 2**48 before they reach int64)")
    return out
