"""Lowering plan copies to NIXL descriptors, in one of two modes (no geometry here: offsets come from
the plan, the tiling from :mod:`kvgeom.lowering`; this module only adds registered base addresses).

    mode "coalesced": one descriptor per plan copy, built per request
        local  [(base[region] + offset, nbytes, dev), ...]   Nx3 uint64
        remote [(base[region] + offset, nbytes, dev), ...]   -> RankAgent.post_coalesced (initialize_xfer)

    mode "prepped": one table per (agent, tile), prepared once; per request two index lists
        table  [(base[region] + entry offset, tile, dev) for every entry of kvgeom.lowering.tile_table]
        idx    kvgeom.lowering.tile_index_pairs(copies, tile, tables)  -> RankAgent.post_prepped (make_prepped_xfer)

Tables are capped at :data:`MAX_TABLE_TILES` entries (NIXL indices are int32): past it, and for a
plan off the tile grid, a link posts coalesced lists instead (docs/design.md §8).

Worked number: 3 copies of 4096 B with a 1024-byte tile post 3 descriptors in mode "coalesced" and
12 index pairs in mode "prepped" (NIXL merges consecutive pairs back into 3 descriptors).
"""

from __future__ import annotations

import numpy as np

from kvgeom import EngineGeometry, PlanError
from kvgeom.lowering import TileTable, tile_table

__all__ = ["MODES", "MAX_TABLE_TILES", "copy_descs", "table_descs", "capped_table"]

MODES = ("coalesced", "prepped")
MAX_TABLE_TILES = 1 << 24  # ~400 MB of Nx3 descriptors; NIXL indices are int32 anyway


def copy_descs(bases: np.ndarray, devices: np.ndarray, region: np.ndarray, offset: np.ndarray,
               nbytes: np.ndarray) -> np.ndarray:
    """``(addr, len, dev)`` rows, one per copy, as an Nx3 uint64 array."""
    out = np.empty((len(region), 3), np.uint64)
    out[:, 0] = bases[region] + offset.astype(np.uint64)
    out[:, 1] = nbytes.astype(np.uint64)
    out[:, 2] = devices[region]
    return out


def table_descs(bases: np.ndarray, devices: np.ndarray, table: TileTable) -> np.ndarray:
    """Every tile of every region of one rank, in table order, as an Nx3 uint64 array."""
    region, offset = table.entries()
    out = np.empty((len(region), 3), np.uint64)
    out[:, 0] = bases[region] + offset.astype(np.uint64)
    out[:, 1] = np.uint64(table.tile_bytes)
    out[:, 2] = devices[region]
    return out


def capped_table(engine: EngineGeometry, tile: int, rank: int | None = None) -> TileTable:
    """One rank's tile table (:func:`kvgeom.lowering.tile_table`: only the regions it holds),
    refused past :data:`MAX_TABLE_TILES`."""
    table = tile_table(engine, tile, rank)
    if table.num_tiles > MAX_TABLE_TILES:
        raise PlanError("tile table", f"{table.num_tiles} tiles of {tile} B for one rank",
                        actual=table.num_tiles, expected=f"<= {MAX_TABLE_TILES}",
                        fix="use mode 'coalesced' for this pair")
    return table
