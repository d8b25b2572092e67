"""Lowering a plan to what an executor posts and runs: fixed-granularity descriptor tables (the
arithmetic of prepared lists, :mod:`.tiles`), receive steps as index rows or strided views
(:mod:`.steps`), and a packed plan's pack and unpack steps likewise (:mod:`.staging`).
"""

from __future__ import annotations

from .staging import (
    MAX_STAGED_RUNS,
    StagedRows,
    StagedRun,
    check_step,
    staged_rows,
    staged_runs,
)
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
    "MAX_STAGED_RUNS",
    "StagedRun",
    "staged_runs",
    "StagedRows",
    "staged_rows",
    "check_step",
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
