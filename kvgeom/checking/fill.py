"""Filling both engines' memory before a plan runs: what P computed, and what D already had.

Per attention group, ``[p0, p1)`` and ``[d0, d1)`` are the token ranges of the listed P and D
blocks, ``M`` the computed tokens and ``S`` the prefix-hit tokens (docs/design.md §3.4)::

    P memory, every rank and region it holds      D memory, every rank and region it holds
    +---------------------------------+           +---------------------------------+
    | coordinate hash in the computed |  a plan   | stale pattern everywhere, but   |
    | tokens [p0, min(p1, M)) of the  | --------> | the coordinate hash in the      |
    | listed blocks and in the listed |           | prefix [d0, min(S, d1)) of the  |
    | state slots; garbage elsewhere  |           | listed blocks (D holds it)      |
    +---------------------------------+           +---------------------------------+

Both backgrounds come from :mod:`kvgeom.checking.hashing` (P's garbage salt "Pgar", D's stale salt
"Dstl"), so an uncomputed P byte that a plan copies and a D byte nobody wrote are both
recognisable afterwards. State slots hold the hash of the tokens they list (a slot that absorbed
40 tokens differs from one that absorbed 32).

Worked number: M = 40, P lists three 16-token blocks from token 0 (``[p0, p1) = [0, 48)``): P tokens
``[0, 40)`` hold the coordinate hash and tokens ``[40, 48)`` keep the garbage, in every layer,
plane and head the P rank holds (on a topology: the layers of its stage and the tokens of its DCP
rank, docs/design.md §11.5).
"""

from __future__ import annotations

from ..values.engine import EngineGeometry
from ..values.model import AttentionSpec
from ..values.pair import CheckedEngines
from ..values.request import Request
from .hashing import SALT_DECODE, SALT_PREFILL, attention_hash, fill_pattern, state_hash
from .memory import Memory, check_memory
from .walk import attention_vectors, listing, state_units, vector_index

__all__ = ["fill_prefill", "fill_decode"]


def _fill_background(mem: Memory, engine: EngineGeometry, side: str, salt: int) -> None:
    """Check ``mem`` fits ``engine``, then fill every byte with the side's salted pattern."""
    check_memory(mem, engine, side)
    for rank, regs in enumerate(mem.buffers):
        for ri, buf in enumerate(regs):
            fill_pattern(buf, salt, rank, ri)


def fill_prefill(pair: CheckedEngines, request: Request, mem: Memory) -> None:
    """P memory: the garbage pattern everywhere, then the coordinate hash in computed tokens
    ``[p0, min(p1, M))`` of every listed block and in every listed state slot (with its tokens)."""
    engine = pair.prefill
    _fill_background(mem, engine, "prefill", SALT_PREFILL)
    M = request.computed_tokens
    for g, spec in enumerate(engine.model.groups):
        lst = listing(request, g, "prefill")
        for rank in range(engine.num_ranks):
            if isinstance(spec, AttentionSpec):
                p0, p1 = lst.token_range(engine.logical_block_tokens)
                for layer, plane, region, starts, tokens, heads in attention_vectors(engine, g, rank, lst,
                                                                                     p0, min(p1, M)):
                    mem.buffers[rank][region][vector_index(starts, spec.head_bytes)] = attention_hash(
                        g, layer, plane, tokens[:, None], heads[None, :], spec.head_bytes)
            else:
                for slot_id, t in zip(lst.slot_ids, lst.tokens, strict=True):
                    for layer, si, region, starts, chans, rows, unit in state_units(engine, g, rank, slot_id):
                        mem.buffers[rank][region][vector_index(starts, unit)] = state_hash(
                            g, layer, si, t, chans[:, None], rows[None, :], unit)


def fill_decode(pair: CheckedEngines, request: Request, mem: Memory) -> None:
    """D memory before the transfer: the stale pattern everywhere, except the prefix tokens
    ``[d0, min(S, d1))`` of listed D blocks, which D already holds (the coordinate hash)."""
    engine = pair.decode
    _fill_background(mem, engine, "decode", SALT_DECODE)
    S = request.prefix_hit_tokens
    for g, spec in enumerate(engine.model.groups):
        if not isinstance(spec, AttentionSpec):
            continue
        lst = listing(request, g, "decode")
        d0, d1 = lst.token_range(engine.logical_block_tokens)
        for rank in range(engine.num_ranks):
            for layer, plane, region, starts, tokens, heads in attention_vectors(engine, g, rank, lst,
                                                                                 d0, min(S, d1)):
                mem.buffers[rank][region][vector_index(starts, spec.head_bytes)] = attention_hash(
                    g, layer, plane, tokens[:, None], heads[None, :], spec.head_bytes)
