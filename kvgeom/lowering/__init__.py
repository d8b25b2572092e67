"""Lowering a plan to fixed-granularity descriptor tables (the arithmetic an executor's prepared lists use).
"""

from __future__ import annotations

from .tiles import (
    TileTable,
    check_in_regions,
    tile_bytes,
    tile_index_pairs,
    tile_quantities,
    tile_rows,
    tile_table,
)

__all__ = [
    "tile_rows",
    "tile_bytes",
    "tile_quantities",
    "TileTable",
    "tile_table",
    "tile_index_pairs",
    "check_in_regions",
]
