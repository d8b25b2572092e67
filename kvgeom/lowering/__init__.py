"""Lowering a plan to what an executor posts and runs: fixed-granularity descriptor tables (the
arithmetic of prepared lists, :mod:`.tiles`) and receive steps as index rows or strided views
(:mod:`.steps`).
"""

from __future__ import annotations

from .steps import (
    RearrangeRows,
    StridedRun,
    ZeroRows,
    rearrange_rows,
    strided_runs,
    zero_rows,
)
from .tiles import (
    TileTable,
    check_in_regions,
    rank_region_bytes,
    tile_bytes,
    tile_index_blocks,
    tile_index_pairs,
    tile_quantities,
    tile_rows,
    tile_table,
)

__all__ = [
    "ZeroRows",
    "zero_rows",
    "RearrangeRows",
    "rearrange_rows",
    "StridedRun",
    "strided_runs",
    "tile_rows",
    "tile_bytes",
    "tile_quantities",
    "TileTable",
    "tile_table",
    "tile_index_pairs",
    "tile_index_blocks",
    "check_in_regions",
    "rank_region_bytes",
]
