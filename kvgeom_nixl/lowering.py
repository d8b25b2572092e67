"""Lowering plan copies to NIXL requests, in one of two modes (no geometry here: offsets come from
the plan, the tiling from :mod:`kvgeom.lowering.tiles`).

    mode "coalesced": one descriptor per plan copy, built per request
        local  [(base[region] + offset, nbytes, dev), ...]   Nx3 uint64
        remote [(base[region] + offset, nbytes, dev), ...]   -> initialize_xfer(op, local, remote, peer)

    mode "prepped": one table per rank, prepared once; per request two index lists
        table  [(base[region] + i * tile, tile, dev) for every tile of every region]
        idx    kvgeom.lowering.tiles.tile_index_pairs(copies, tile, tables)  -> make_prepped_xfer(op, L, li, R, ri)

Worked number: 3 copies of 4096 B with a 1024-byte tile post 3 descriptors in mode "coalesced" and
12 index pairs in mode "prepped" (NIXL merges consecutive pairs back into 3 descriptors).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from kvgeom.lowering import TileTable

__all__ = ["MODES", "copy_descs", "table_descs", "post_coalesced", "post_prepped", "as_nixl_indices"]

MODES = ("coalesced", "prepped")


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


def as_nixl_indices(idx: np.ndarray) -> np.ndarray:
    """NIXL takes int32 index arrays; tables are capped so the conversion is exact."""
    return np.ascontiguousarray(idx, dtype=np.int32)


def post_coalesced(agent: Any, op: str, local: np.ndarray, local_mem: str, remote: np.ndarray, remote_mem: str,
                   peer: str, notif: bytes) -> Any:
    """A one-shot NIXL request over two descriptor arrays (``initialize_xfer``: NIXL does not merge)."""
    return agent.initialize_xfer(op, agent.get_xfer_descs(local, local_mem), agent.get_xfer_descs(remote, remote_mem),
                                 peer, notif)


def post_prepped(agent: Any, op: str, local_handle: Any, local_idx: np.ndarray, remote_handle: Any,
                 remote_idx: np.ndarray, notif: bytes) -> Any:
    """A NIXL request from index lists into two prepared tables (NIXL merges +1 runs)."""
    return agent.make_prepped_xfer(op, local_handle, as_nixl_indices(local_idx), remote_handle,
                                   as_nixl_indices(remote_idx), notif)
