"""Describe a byte: the global coordinate (docs/design.md §3.1) a byte of an engine's memory holds, in words.

Violations name the coordinate behind their first bad byte, so a failing plan reads as "layer 3,
V, token 700, head 5" instead of "region 2 byte 9_437_440". The search runs the geometry forward
(every view of every group that uses the region) and matches the offset, so it needs no inverse of
the layout and stays correct for every layout the geometry can express::

    offset --divmod page_bytes--> (page, within) --page // ppl--> logical block
    for each (layer, plane) view in this region:  starts[head, slot] = attention_address(..., page 0)
        within - starts in [0, head_bytes)?  --> head, slot, byte; token from the request's listing

A byte of a page the request does not list is described by page and slot; a byte no view covers is
padding. It is slow and used only for listed violations.

Worked number: P engine TP1, HND, 2 local heads of 256 B, K = 16, K/V packed, one group "attn",
block 0 listed from token 0: byte 13568 = 8192 + 4096 + 5 * 256 of page 0 is
``attn layer 0 V token 5 head 1 byte 0``.
"""

from __future__ import annotations

import numpy as np

from ..errors import InternalError
from ..values.engine import EngineGeometry
from ..values.layout import AttentionGroupGeometry, StateGroupGeometry
from ..values.model import AttentionSpec, StateSpec
from ..values.request import BlockList, Request, StateSlots
from .walk import listing as walk_listing

__all__ = ["describe"]


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
    ppl = engine.blocks_per_logical
    dcp, interleave = engine.topology.dcp, engine.topology.interleave
    dcp_rank = engine.coords(rank).dcp_rank
    holds = engine.holds(rank)
    found: list[tuple[bool, str]] = []
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
                    hit = np.argwhere((rel >= 0) & (rel < spec.head_bytes))
                    if not hit.size:
                        continue
                    h, s = (int(x) for x in hit[0])
                    pname = "latent" if spec.planes == 1 else "KV"[plane]
                    listed = isinstance(listing, BlockList) and block in listing.block_ids
                    if listed:
                        if not isinstance(listing, BlockList):
                            raise InternalError("narrowed for mypy")
                        # slot s of this rank's page holds chunk s // I of the page's tokens on it (§10.2)
                        o = ((s // interleave) * dcp + dcp_rank) * interleave + s % interleave
                        token = (listing.first_token + listing.block_ids.index(block) * engine.logical_block_tokens
                                 + sub * engine.kernel_block_tokens * dcp + o)
                        where = f"token {token}"
                    else:
                        where = f"slot {s} of page {page} (block {block} not listed)"
                    found.append((listed, f"{spec.name} layer {layer} {pname} {where} head {held.start + h} "
                                          f"byte {int(rel[h, s])}"))
        elif isinstance(spec, StateSpec) and isinstance(geo, StateGroupGeometry):
            slot_id, within = divmod(offset, engine.logical_page_bytes(region))
            listed = isinstance(listing, StateSlots) and slot_id in listing.slot_ids
            if listed:
                if not isinstance(listing, StateSlots):
                    raise InternalError("narrowed for mypy")
                tag = f"slot {slot_id}, {listing.tokens[listing.slot_ids.index(slot_id)]} tokens"
            else:
                tag = f"slot {slot_id} not listed"
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
                        found.append((listed, f"{spec.name} layer {layer} section {sec.name!r} channel "
                                              f"{held.start + c} row {w} byte {int(rel[c, w])} ({tag})"))
    if not found:
        page, within = divmod(offset, reg.page_bytes)
        return f"padding: page {page} byte {within} (no coordinate lives here)"
    found.sort(key=lambda f: not f[0])  # listed blocks first
    return found[0][1]
