"""Walking the model: which bytes of an engine hold which coordinate, and which pages a request lists.

Everything here is derived from the model alone (docs/design.md §3): the geometry's
``attention_address`` / ``state_address``, TP ownership (``owned_slice``, §3.3) and the request's
block lists (§3.4). It never asks the planner.

The simulator keeps its OWN token -> (kernel page, slot) arithmetic (:func:`page_slot`) instead of
using ``kvgeom.arith.tokens``: it is the oracle's independent copy, so a bug in the shared
arithmetic that the planner relies on shows up as a violation instead of cancelling out::

    listing: first_token t0, block_ids (b_0, b_1, ...), B tokens per logical block,
             ppl = B / K kernel pages per logical block
    token t: rel = t - t0;  block = b_[rel // B];  page = block * ppl + (rel % B) // K;  slot = rel % K

**Listed pages** of a side: for every group and every region the group lives in, the kernel pages
``b*ppl .. b*ppl + ppl - 1`` of each listed logical block (attention) or slot (state: the slot's
logical page). Plan-level checks allow D writes and P reads there and nowhere else (docs/design.md
§4.2, invariant 1). Padding bytes inside listed pages are allowed writes at plan level, but the
content check wants them unchanged (``CLOBBERED``). D's **writable pages** are its listed pages
minus the attention pages it already holds whole (the prefix ``[0, S)``).

Worked number: B = 32, K = 16 (ppl = 2), a listing from token 64 of blocks (7, 3): token 116 has
rel = 52, block 3 (52 // 32 = 1), page 3 * 2 + (52 % 32) // 16 = 7, slot 52 % 16 = 4; the listed
pages are 14, 15, 6 and 7.

On a topology (docs/design.md §11) a rank holds the layers of its stage, the heads of its head
group and, with DCP, the tokens ``t`` with ``(t // I) % dcp`` equal to its DCP rank; this module
reads them from ``EngineGeometry.holds(rank)`` and keeps its own copy of the DCP slot arithmetic::

    c = dcp, I = interleave:  block = b_[rel // (B*c)];  page = block * ppl + (rel % (B*c)) // (K*c)
                              o = rel % (K*c);  slot = (o // (c*I)) * I + o % I

Worked number: K = 64, ppl = 1, c = 8, I = 1, token 1000 of a listing from 0: block index 1,
o = 488, owner 488 % 8 = 0, slot 488 // 8 = 61.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np

from ..errors import InternalError, RequestError
from ..values.engine import EngineGeometry
from ..values.model import AttentionSpec, StateSpec
from ..values.pair import CheckedEngines
from ..values.request import BlockList, Request
from .memory import CHUNK

__all__ = ["listed_pages", "writable_pages"]


def page_slot(engine: EngineGeometry, listing: BlockList, tokens: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Kernel page and slot of each token of a side's listed blocks (tokens inside the listing).

    The oracle's own copy of token -> (page, slot); see the module docstring for why it is not shared.
    """
    K, ppl = engine.kernel_block_tokens, engine.blocks_per_logical
    c, interleave = engine.topology.dcp, engine.topology.interleave
    B = K * ppl * c  # request tokens of one logical block
    rel = tokens - listing.first_token
    ids = np.asarray(listing.block_ids, dtype=np.int64)
    page = ids[rel // B] * ppl + (rel % B) // (K * c)
    o = rel % (K * c)
    return page, (o // (c * interleave)) * interleave + o % interleave


def attention_vectors(engine: EngineGeometry, group: int, rank: int, listing: BlockList, lo: int,
                      hi: int) -> Iterator[tuple[int, int, int, np.ndarray, np.ndarray, np.ndarray]]:
    """For tokens ``[lo, hi)`` of the listed blocks, chunked: ``(layer, plane, region, starts, tokens,
    heads)``; ``starts[n, h]`` is the head vector of ``tokens[n]`` and global head ``heads[h]``."""
    spec = engine.model.groups[group]
    if not isinstance(spec, AttentionSpec):
        raise InternalError("callers dispatch on the spec type")
    holds = engine.holds(rank)[spec.name]
    held, layers, shard = holds["heads"], holds["layers"], holds["tokens"]
    local = np.arange(held.size, dtype=np.int64)
    step = max(1, CHUNK // (held.size * spec.head_bytes))
    for t0 in range(lo, hi, step):
        tokens = np.arange(t0, min(hi, t0 + step), dtype=np.int64)
        if shard.size > 1:  # the rank's DCP tokens only
            tokens = tokens[(tokens // shard.interleave) % shard.size == shard.rank]
            if not len(tokens):
                continue
        page, slot = page_slot(engine, listing, tokens)
        for layer in range(layers.start, layers.stop):
            for plane in range(spec.planes):
                region, starts = engine.attention_address(group, layer, plane, page[:, None], slot[:, None],
                                                          local[None, :])
                yield layer, plane, region, starts, tokens, local + held.start


def state_units(engine: EngineGeometry, group: int, rank: int,
                slot_id: int) -> Iterator[tuple[int, int, int, np.ndarray, np.ndarray, np.ndarray, int]]:
    """Every unit of one state slot on one rank: ``(layer, section, region, starts[c, w], channels,
    rows, unit_bytes)`` with global channel numbers."""
    spec = engine.model.groups[group]
    if not isinstance(spec, StateSpec):
        raise InternalError("callers dispatch on the spec type")
    holds = engine.holds(rank)[spec.name]
    layers = holds["layers"]
    for layer in range(layers.start, layers.stop):
        for si, sec in enumerate(spec.sections):
            held = holds[sec.name]
            rows = np.arange(sec.rows, dtype=np.int64)
            step = max(1, CHUNK // (sec.rows * sec.unit_bytes))
            for c0 in range(0, held.size, step):
                local = np.arange(c0, min(held.size, c0 + step), dtype=np.int64)
                region, starts = engine.state_address(group, layer, si, slot_id, local[:, None], rows[None, :])
                yield layer, si, region, starts, local + held.start, rows, sec.unit_bytes


def vector_index(starts: np.ndarray, nbytes: int) -> np.ndarray:
    """Byte index of every byte of every vector: ``starts[..., None] + arange(nbytes)``."""
    return starts[..., None] + np.arange(nbytes, dtype=np.int64)


def listing(request: Request, group: int, side: str) -> Any:
    """The request's listing of ``group`` on ``side`` ("prefill" or "decode"): BlockList or StateSlots."""
    return getattr(request.groups[group], side)


def listed_pages(engine: EngineGeometry, request: Request, side: str) -> dict[int, np.ndarray]:
    """``{region: bool[num_pages]}``: the kernel pages the request lists on ``side``.

    Raises :class:`RequestError` when two groups list the same page of a shared region (their
    bytes would alias).
    """
    ppl = engine.blocks_per_logical
    owner: dict[int, np.ndarray] = {}
    for g in range(len(engine.model.groups)):
        lst = listing(request, g, side)
        ids = lst.block_ids if isinstance(lst, BlockList) else lst.slot_ids
        pages = (np.asarray(ids, dtype=np.int64)[:, None] * ppl + np.arange(ppl)).ravel()
        for r in engine.group_regions(g):
            own = owner.setdefault(r, np.full(engine.regions[r].num_pages, -1, np.int64))
            prev = own[pages]
            clash = prev[(prev >= 0) & (prev != g)]
            if clash.size:
                other = engine.model.groups[int(clash[0])].name
                raise RequestError(f"Request.groups[{g}]({engine.model.groups[g].name}).{side}",
                                   f"lists pages of region {r} that group {other!r} also lists",
                                   actual=sorted(set(ids)), expected="block ids no other group uses in that region",
                                   fix="give groups that share a region distinct block ids")
            own[pages] = g
    return {r: own >= 0 for r, own in owner.items()}


def writable_pages(engine: EngineGeometry, request: Request) -> dict[int, np.ndarray]:
    """D's listed pages minus the attention pages D already holds whole (the prefix ``[0, S)``).

    ``S`` lies on a D logical-block boundary, so a listed block is either entirely before ``S``
    (held: a plan must not write it, even with identical bytes) or entirely from ``S`` on.
    """
    out = {r: m.copy() for r, m in listed_pages(engine, request, "decode").items()}
    ppl, B, S = engine.blocks_per_logical, engine.logical_block_tokens, request.prefix_hit_tokens
    for g in range(len(engine.model.groups)):
        lst = listing(request, g, "decode")
        if not isinstance(lst, BlockList):
            continue
        held = [b for i, b in enumerate(lst.block_ids) if lst.first_token + (i + 1) * B <= S]
        if not held:
            continue
        pages = (np.asarray(held, dtype=np.int64)[:, None] * ppl + np.arange(ppl)).ravel()
        for r in engine.group_regions(g):
            out[r][pages] = False
    return out


def check_request(pair: CheckedEngines, request: Request) -> None:
    """Raise unless ``request`` fits ``pair`` and no two groups list one page of a shared region."""
    pair.check_request(request)
    listed_pages(pair.prefill, request, "prefill")
    listed_pages(pair.decode, request, "decode")
