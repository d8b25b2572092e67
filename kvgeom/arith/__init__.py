"""Integer arithmetic every layer above shares: TP slices, token -> (page, slot), strided runs.

Pure functions of ints and int64 arrays; no value classes (those are :mod:`kvgeom.values`).
"""

from __future__ import annotations

from .ints import (
    MAX_INT,
    ceil_div,
)
from .runs import (
    Mode,
    element_offsets,
    fold_modes,
    run_bases,
    run_offsets,
    strided_rows,
)
from .shard import (
    Slice,
    SourceSlice,
    TokenShard,
    check_divisible,
    divisible,
    layer_partition,
    local_count,
    owned_slice,
    sources,
    stage_slices,
)
from .tokens import (
    Segments,
    SideTokens,
    locate,
    segments,
    window_start,
)

__all__ = [
    "MAX_INT",
    "ceil_div",
    "Mode",
    "fold_modes",
    "strided_rows",
    "run_bases",
    "run_offsets",
    "element_offsets",
    "Slice",
    "owned_slice",
    "local_count",
    "divisible",
    "check_divisible",
    "sources",
    "SourceSlice",
    "layer_partition",
    "stage_slices",
    "TokenShard",
    "SideTokens",
    "Segments",
    "segments",
    "locate",
    "window_start",
]
