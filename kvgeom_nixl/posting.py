"""One rank's copies as NIXL requests: descriptor lists or prepared-table indices, checked first
(docs/design.md §8, "Lowering, two modes").

    posters(link, transfer, copies, "READ" | "WRITE")  -> {peer agent: poster}
      every row checked against both ranks' regions (kvgeom.lowering.check_in_regions)
      mode coalesced: one descriptor per copy row      (kvgeom_nixl.lowering.copy_descs)
      mode prepped:   index pairs into the two ranks' tile tables, prepared once per (agent, tile)
                      (kvgeom.lowering.tile_index_pairs, or tile_index_blocks from the compiled pair)
      poster(notification) -> (NIXL handle, descriptors, bytes)    posted when the protocol lets it

A poster is called by the transfer (:meth:`~kvgeom_nixl.transfer.Transfer._post_to`) once the peer
has granted (pull) or asked (push), with that peer's signed notification; nothing here sends a
message or waits. A plan off the tile grid, or a table beyond ``MAX_TABLE_TILES``, falls back to
coalesced lists (a ``PREPPED_FALLBACK`` note).

Worked number: a D rank of P TP2 -> D TP1 reading 4 fresh blocks gets two posters, one per P rank,
each one coalesced descriptor per (region, block run) it reads from that rank.
"""

from __future__ import annotations

from typing import Any, Protocol

import numpy as np

from kvgeom import Copies, EngineGeometry, Pair, PlanError
from kvgeom.lowering import check_in_regions, tile_index_blocks, tile_index_pairs
from kvgeom.values import CopyBlock

from .agent import RankAgent, classify, nixl_errors
from .handshake import RankInfo
from .lowering import capped_table, copy_descs, table_descs
from .memory import RankMemory
from .transfer import Poster, Transfer

__all__ = ["posters", "sides", "tile_indices", "Side"]


class _Rank(Protocol):
    engine: EngineGeometry
    rank: int
    memory: RankMemory
    rank_agent: RankAgent


class Side(Protocol):
    """What posting needs of a :class:`~kvgeom_nixl.link.Link`: its endpoint, pair, direction, tile
    size and the peer ranks' handshakes."""

    pair: Pair

    @property
    def endpoint(self) -> _Rank: ...

    @property
    def local_is_decode(self) -> bool: ...

    @property
    def tile_bytes(self) -> int: ...

    def peer_info(self, rank: int) -> RankInfo: ...


def posters(link: Side, t: Transfer, copies: Copies, op: str,
            blocks: tuple[CopyBlock, ...] | None = None) -> dict[str, Poster]:
    """Lower this rank's ``copies`` to one NIXL request per peer rank, posted once the protocol
    lets it (:meth:`Transfer._post_to`, with that peer's signed notification).

    Every row is checked against the regions the two ranks hold (a region of another pipeline
    stage has 0 bytes there, docs/design.md §11.4) before anything is posted. A bad plan fails
    ``t``; a plan that needs a peer rank this link was not given raises :class:`ExecutorError`.
    """
    agent = link.endpoint.rank_agent
    out: dict[str, Poster] = {}
    try:
        peer_col, lreg, loff, rreg, roff = sides(copies, link.local_is_decode)
        peers = [link.peer_info(int(p)) for p in np.unique(peer_col)]  # every peer the rows need, first
        rows_of = {info.rank: np.flatnonzero(peer_col == info.rank) for info in peers}
        for info in peers:
            mine = copies.take(rows_of[info.rank])
            if link.local_is_decode:
                check_in_regions(mine, info.sizes, link.endpoint.memory.sizes)
            else:
                check_in_regions(mine, link.endpoint.memory.sizes, info.sizes)
        prepped = tile_indices(link, t, copies, rows_of, blocks) if t.mode == "prepped" and len(copies) else None
        for info in peers:
            rows = rows_of[info.rank]
            nbytes = int(copies.nbytes[rows].sum())
            if prepped is None:
                local = copy_descs(link.endpoint.memory.bases, link.endpoint.memory.devices, lreg[rows],
                                   loff[rows], copies.nbytes[rows])
                remote = copy_descs(info.bases, info.devices, rreg[rows], roff[rows], copies.nbytes[rows])

                def coalesced(notif: bytes, local: np.ndarray = local, remote: np.ndarray = remote,
                              info: RankInfo = info, n: int = len(rows), nbytes: int = nbytes) -> tuple[Any, int, int]:
                    return agent.post_coalesced(op, local, remote, info.mem_type, info.agent, notif), n, nbytes

                out[info.agent] = coalesced
            else:
                local_idx, remote_idx = prepped[info.rank]
                local_table, remote_table = _local_table(link), _remote_table(link, info)

                def indexed(notif: bytes, li: np.ndarray = local_idx, ri: np.ndarray = remote_idx,
                            lt: Any = local_table, rt: Any = remote_table, nbytes: int = nbytes) -> tuple[Any, int, int]:
                    return agent.post_prepped(op, lt, li, rt, ri, notif), len(li), nbytes

                out[info.agent] = indexed
    except nixl_errors() as e:
        t.fail(classify(e), f"posting: {type(e).__name__}: {e}")
    except (PlanError, RuntimeError, KeyError) as e:
        t.fail("plan_error" if isinstance(e, PlanError) else "nixl_error", f"posting: {type(e).__name__}: {e}")
    return out

def sides(copies: Copies, on_decode: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(peer rank, local region, local offset, peer region, peer offset) columns, seen from a D rank
    (``on_decode``) or a P rank."""
    if on_decode:
        return copies.p_rank, copies.d_region, copies.d_offset, copies.p_region, copies.p_offset
    return copies.d_rank, copies.p_region, copies.p_offset, copies.d_region, copies.d_offset

def tile_indices(link: Side, t: Transfer, copies: Copies, rows_of: dict[int, np.ndarray],
                 blocks: tuple[CopyBlock, ...] | None = None) -> dict[int, tuple[np.ndarray, np.ndarray]] | None:
    """Mode prepped: per peer rank, (local indices, peer indices) into the two ranks' tables, or
    ``None`` (``t`` falls back to coalesced) when the plan is off the tile grid or a table is
    too large. Each rank's table has tiles only for the regions it holds. With ``blocks`` (the
    compiled pair's rows of this rank) the indices come straight from them
    (:func:`kvgeom.lowering.tile_index_blocks`), not from the byte columns."""
    tile = link.tile_bytes
    me = link.endpoint.rank
    out: dict[int, tuple[np.ndarray, np.ndarray]] = {}
    try:
        if blocks is not None:
            pair = link.pair
            got = tile_index_blocks(blocks, tile, p_tables=lambda r: capped_table(pair.prefill, tile, r),
                                    d_tables=lambda r: capped_table(pair.decode, tile, r))
            for (p_rank, d_rank), (p_idx, d_idx) in got.items():
                peer = p_rank if link.local_is_decode else d_rank
                out[peer] = (d_idx, p_idx) if link.local_is_decode else (p_idx, d_idx)
            if set(out) != set(rows_of):
                raise PlanError("blocks", "the blocks and the plan's copies name different peers",
                                actual=sorted(out), expected=sorted(rows_of))
            return out
        for peer, rows in rows_of.items():
            p_rank, d_rank = (peer, me) if link.local_is_decode else (me, peer)
            p_idx, d_idx = tile_index_pairs(copies.take(rows), tile,
                                            p_table=capped_table(link.pair.prefill, tile, p_rank),
                                            d_table=capped_table(link.pair.decode, tile, d_rank))
            out[peer] = (d_idx, p_idx) if link.local_is_decode else (p_idx, d_idx)
    except PlanError as e:
        t.fall_back("coalesced", e.message)
        return None
    return out

def _local_table(link: Side) -> Any:
    """This rank's prepared table (shared by every link of the endpoint)."""
    mem = link.endpoint.memory
    return _prepared(link, "", link.endpoint.engine, link.endpoint.rank, mem.bases, mem.devices, mem.mem_type)

def _remote_table(link: Side, info: RankInfo) -> Any:
    return _prepared(link, info.agent, info.engine, info.rank, info.bases, info.devices, info.mem_type)

def _prepared(link: Side, agent_name: str, engine: EngineGeometry, rank: int, bases: np.ndarray, devices: np.ndarray,
              mem_type: str) -> Any:
    agent = link.endpoint.rank_agent
    handle = agent.prepared(agent_name, link.tile_bytes)
    if handle is None:
        descs = table_descs(bases, devices, capped_table(engine, link.tile_bytes, rank))
        handle = agent.prepare(agent_name, link.tile_bytes, descs, mem_type)
    return handle
