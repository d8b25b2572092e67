"""Describe a byte: the global coordinate (docs/design.md §3.1) a byte of an engine's memory holds, in words.

Violations name the coordinate behind their first bad byte, so a failing plan reads as "layer 3,
V, token 700, head 5" instead of "region 2 byte 9_437_440". The search runs the geometry forward
(every view of every group that uses the region) and matches the offset, so it needs no inverse of
the layout and stays correct for every layout the geometry can express::

    offset --divmod page_bytes--> (page, within) --page // ppl--> logical block
    for each (layer, plane) view in this region:  starts[head, slot] = attention_address(..., page 0)
        within - starts in [0, head_bytes)?  --> head, slot, byte; token from the request's listing

A byte of a page the request does not list is described by page and slot; a byte no view covers is
padding. It is slow and used only for listed violations. :func:`locate_byte` gives the same answer as a
:class:`ByteCoordinate` (group, layer, plane, head, token, logical block...) for code that reports
in other terms (the conformance kit names a connector's block ids and tokens).

Worked number: P engine TP1, HND, 2 local heads of 256 B, K = 16, K/V packed, one group "attn",
block 0 listed from token 0: byte 13568 = 8192 + 4096 + 5 * 256 of page 0 is
``attn layer 0 V token 5 head 1 byte 0``.
"""

from __future__ import annotations

import attrs
import numpy as np

from ..values.engine import EngineGeometry
from ..values.layout import AttentionGroupGeometry, StateGroupGeometry
from ..values.model import AttentionSpec, StateSpec
from ..values.request import BlockList, Request, StateSlots
from .walk import listing as walk_listing

__all__ = ["describe", "locate_byte", "ByteCoordinate"]


@attrs.frozen
class ByteCoordinate:
    """The global coordinate one byte of an engine's memory holds (docs/design.md §3.1), and where.

    ``kind`` is ``"attention"`` or ``"state"``. Attention: ``plane`` (0 K, 1 V; MLA's latent is 0),
    global ``head``, kernel ``page`` and ``slot``, logical ``block`` (``page // ppl``) and ``token``
    (``None`` when the request does not list that block on that side). State: ``section``, global
    ``channel``, ``row`` and the ``block`` (slot id); ``tokens`` is what that slot's state has
    absorbed when listed. ``byte`` is the byte inside the head vector or unit.
    """

    kind: str
    group: str
    group_index: int
    layer: int
    listed: bool
    block: int
    byte: int
    plane: int = 0
    plane_name: str = ""
    head: int = 0
    page: int = 0
    slot: int = 0
    token: int | None = None
    section: str = ""
    channel: int = 0
    row: int = 0
    tokens: int | None = None

    def __str__(self) -> str:
        if self.kind == "attention":
            where = f"token {self.token}" if self.listed else \
                f"slot {self.slot} of page {self.page} (block {self.block} not listed)"
            return f"{self.group} layer {self.layer} {self.plane_name} {where} head {self.head} byte {self.byte}"
        tag = f"slot {self.block}, {self.tokens} tokens" if self.listed else f"slot {self.block} not listed"
        return (f"{self.group} layer {self.layer} section {self.section!r} channel {self.channel} row {self.row} "
                f"byte {self.byte} ({tag})")


def locate_byte(engine: EngineGeometry, request: Request | None, side: str, rank: int, region: int,
                offset: int) -> ByteCoordinate | None:
    """The coordinate byte ``offset`` of ``region`` holds on ``rank`` (``None``: padding, or outside
    the region). Where several groups overlay the byte, a block the request lists wins."""
    if not 0 <= region < len(engine.regions):
        return None
    reg = engine.regions[region]
    if not 0 <= offset < reg.nbytes:
        return None
    if not 0 <= rank < engine.num_ranks or region not in engine.rank_regions(rank):
        return None  # another pipeline stage's region (docs/design.md §11.4)
    ppl = engine.blocks_per_logical
    dcp, interleave = engine.topology.dcp, engine.topology.interleave
    dcp_rank = engine.coords(rank).dcp_rank
    holds = engine.holds(rank)
    found: list[ByteCoordinate] = []
    for g, spec in enumerate(engine.model.groups):
        if region not in engine.group_regions(g):
            continue
        listing = walk_listing(request, g, side) if request is not None else None
        geo = engine.groups[g]
        if isinstance(spec, AttentionSpec) and isinstance(geo, AttentionGroupGeometry):
            page, within = divmod(offset, reg.page_bytes)
            block, sub = divmod(page, ppl)
            held = holds[spec.name]["heads"]
            heads = np.arange(held.size)[:, None]
            slots = np.arange(engine.kernel_block_tokens)[None, :]
            for layer, view in enumerate(geo.views):
                for plane, preg in enumerate(view.regions):
                    if preg != region:
                        continue
                    _, starts = engine.attention_address(g, layer, plane, 0, slots, heads)
                    rel = within - starts
                    table = engine.attention_vector_bytes(g, plane)  # a split head vector's bytes (§3.5)
                    hit = np.argwhere(np.isin(rel, table))
                    if not hit.size:
                        continue
                    h, sl = (int(x) for x in hit[0])
                    rel[h, sl] = int(np.flatnonzero(table == rel[h, sl])[0])  # the byte's index in the vector
                    listed = isinstance(listing, BlockList) and block in listing.block_ids
                    token = None
                    if isinstance(listing, BlockList) and listed:
                        # slot sl of this rank's page holds chunk sl // I of its tokens there (§11.2)
                        o = ((sl // interleave) * dcp + dcp_rank) * interleave + sl % interleave
                        token = (listing.first_token + listing.block_ids.index(block) * engine.logical_block_tokens
                                 + sub * engine.kernel_block_tokens * dcp + o)
                    found.append(ByteCoordinate("attention", spec.name, g, layer, listed, block, int(rel[h, sl]),
                                                plane=plane, plane_name="latent" if spec.planes == 1 else "KV"[plane],
                                                head=held.start + h, page=page, slot=sl, token=token))
        elif isinstance(spec, StateSpec) and isinstance(geo, StateGroupGeometry):
            slot_id, within = divmod(offset, engine.logical_page_bytes(region))
            listed = isinstance(listing, StateSlots) and slot_id in listing.slot_ids
            absorbed = listing.tokens[listing.slot_ids.index(slot_id)] \
                if isinstance(listing, StateSlots) and listed else None
            for layer, sview in enumerate(geo.views):
                if sview.region != region:
                    continue
                for si, sec in enumerate(spec.sections):
                    held = holds[spec.name][sec.name]
                    ch = np.arange(held.size)[:, None]
                    rows = np.arange(sec.rows)[None, :]
                    _, starts = engine.state_address(g, layer, si, 0, ch, rows)
                    rel = within - starts
                    hit = np.argwhere((rel >= 0) & (rel < sec.unit_bytes))
                    if hit.size:
                        c, w = (int(x) for x in hit[0])
                        found.append(ByteCoordinate("state", spec.name, g, layer, listed, slot_id, int(rel[c, w]),
                                                    section=sec.name, channel=held.start + c, row=w,
                                                    tokens=absorbed))
    if not found:
        return None
    found.sort(key=lambda f: not f.listed)  # listed blocks first
    return found[0]


def describe(engine: EngineGeometry, request: Request | None, side: str, rank: int, region: int,
             offset: int) -> str:
    """The global coordinate byte ``offset`` of ``region`` holds on ``rank``, in words.

    Found by searching the model (every view of every group that uses the region), so it is slow
    and used only for listed violations. A byte of a page the request does not list is described
    by page and slot; a byte no view covers is padding.
    """
    if not 0 <= region < len(engine.regions):
        return f"(region {region} does not exist)"
    reg = engine.regions[region]
    if not 0 <= offset < reg.nbytes:
        return f"(byte {offset} is outside region {region}'s {reg.nbytes} B)"
    if not 0 <= rank < engine.num_ranks:
        return f"(rank {rank} does not exist: {engine.num_ranks} ranks)"
    if region not in engine.rank_regions(rank):
        return (f"(region {region} belongs to stage {engine.region_stage(region)}, not to rank {rank}'s stage "
                f"{engine.coords(rank).stage})")
    where = locate_byte(engine, request, side, rank, region, offset)
    if where is None:
        page, within = divmod(offset, reg.page_bytes)
        return f"padding: page {page} byte {within} (no coordinate lives here)"
    return str(where)
