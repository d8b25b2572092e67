"""Drawings of a transfer (matplotlib, imported only when a drawing is made).
"""

from __future__ import annotations

from .drawing import (
    NOT_LISTED,
    SEVERAL,
    SOURCE_STRIDE,
    UNTOUCHED,
    ZEROED,
    CellMap,
    DrawError,
    Row,
    draw,
    save,
    transfer_cells,
)

__all__ = [
    "CellMap",
    "Row",
    "DrawError",
    "transfer_cells",
    "draw",
    "save",
    "NOT_LISTED",
    "ZEROED",
    "UNTOUCHED",
    "SEVERAL",
    "SOURCE_STRIDE",
]
