"""Requests built from a few numbers: fresh consecutive blocks on both sides (the CLI's default).

P lists blocks for ``[0, M)``; D lists blocks for ``[S, N)``. Sliding groups list only the blocks
from the window's start (``kvgeom.arith.tokens.window_start(M, W)``, the one rule) on each side;
state groups list one running state::

    M = 40, S = 16, B_p = 16, B_d = 8      P: ids 0 1 2 from token 0     (tokens [0, 48))
                                           D: ids 0 1 2 from token 16    (tokens [16, 40))

:func:`fresh_shape` is the same request by size only (token ranges and block counts, no ids), in
O(groups): what the work budget checks before a request is built (docs/design.md §14), so that a
request of 10**8 tokens is refused before its block lists exist. :func:`fresh_request` also refuses,
before making any id, a listing that runs past a side's block pool.

Worked number: the example above lists ``ceil_div(40, 16) = 3`` P blocks and
``ceil_div(40 - 16, 8) = 3`` D blocks.
"""

from __future__ import annotations

from ..arith.ints import ceil_div
from ..arith.tokens import window_start
from ..errors import RequestError
from ..values.fields import check_int
from ..values.model import AttentionSpec, StateSpec
from ..values.pair import CheckedEngines
from ..values.request import BlockList, GroupRequest, ListingShape, Request, RequestShape, SideBlocks, StateSlots

__all__ = ["fresh_request", "fresh_span", "fresh_shape"]


def fresh_span(spec: AttentionSpec, block_tokens: int, computed_tokens: int, lo: int, hi: int) -> tuple[int, int]:
    """(first token, block count) of a fresh listing of tokens ``[lo, hi)`` for an attention group:
    from ``lo``'s block (a sliding group from its window's start, if later) to the block of ``hi - 1``.

    >>> from kvgeom.values.model import AttentionSpec
    >>> fresh_span(AttentionSpec("swa", "sliding", 1, 1, 8, window_tokens=16), 8, 100, 0, 101)
    (80, 3)
    """
    B = block_tokens
    first = lo // B * B
    if spec.window_tokens is not None:
        first = max(first, window_start(computed_tokens, spec.window_tokens) // B * B)
    return first, (ceil_div(hi - first, B) if hi > first else 0)


def _listings(pair: CheckedEngines, computed_tokens: int, decode_tokens: int | None,
              prefix_hit_tokens: int) -> list[tuple[ListingShape, ListingShape] | None]:
    """Per group, the (P, D) listing shapes of a fresh request; ``None`` for a state group (one running slot)."""
    M = check_int("computed_tokens", computed_tokens, minimum=0, error=RequestError)
    S = check_int("prefix_hit_tokens", prefix_hit_tokens, minimum=0, error=RequestError)
    N = M if decode_tokens is None else check_int("decode_tokens", decode_tokens, minimum=0, error=RequestError)
    out: list[tuple[ListingShape, ListingShape] | None] = []
    for spec in pair.model.groups:
        if isinstance(spec, StateSpec):
            out.append(None)
            continue
        sides = [ListingShape(*fresh_span(spec, pair.side(side_name).logical_block_tokens, M, lo, hi))
                 for side_name, lo, hi in (("prefill", 0, M), ("decode", S, N))]
        out.append((sides[0], sides[1]))
    return out


def _fits(pair: CheckedEngines, gi: int, side: str, first: int, count: int) -> None:
    """Refuse, before any id is made, a fresh listing that runs past the side's block pool."""
    eng = pair.side(side)
    pool = min(eng.num_logical_blocks(r) for r in eng.group_regions(gi))
    if first + count > pool:
        name = pair.model.groups[gi].name
        raise RequestError(f"fresh_request.groups[{gi}]({name}).{side}", f"ids {first}..{first + count - 1} for "
                           f"{count} blocks run past the {pool} logical blocks of {side}'s regions",
                           actual=first + count, expected=f"<= {pool} blocks",
                           fix="request fewer tokens, or give the engine more blocks")


def fresh_shape(pair: CheckedEngines, computed_tokens: int, *, decode_tokens: int | None = None,
                prefix_hit_tokens: int = 0) -> RequestShape:
    """The shape of :func:`fresh_request` (token ranges and block counts, no ids), in O(groups): what
    the work budget checks before a request of ``computed_tokens`` is built (docs/design.md §14)."""
    listings = _listings(pair, computed_tokens, decode_tokens, prefix_hit_tokens)
    groups = tuple(lst if lst is not None else (ListingShape(0, 1), ListingShape(0, 1)) for lst in listings)
    pairs = tuple(1 if lst is None else None for lst in listings)
    return RequestShape(int(computed_tokens), int(prefix_hit_tokens), groups, pairs)


def fresh_request(
    pair: CheckedEngines,
    computed_tokens: int,
    *,
    decode_tokens: int | None = None,
    prefix_hit_tokens: int = 0,
    prefill_first_block: int = 0,
    decode_first_block: int = 0,
) -> Request:
    """A request on fresh consecutive blocks: the common case, and the CLI's default.

    P lists blocks for ``[0, M)``; D lists blocks for ``[S, N)`` (``N = decode_tokens``, default
    ``M``; the mamba N-1 rule gives ``N = M + 1``). Sliding groups list only the blocks their
    window needs at the end of each side's range; state groups list one running state after M
    tokens. Ids are handed out group after group from the ``*_first_block`` counters, so groups
    that share a region never share a block. A listing that would run past a side's block pool is
    refused (:class:`~kvgeom.errors.RequestError`) before any id is made.
    """
    listings = _listings(pair, computed_tokens, decode_tokens, prefix_hit_tokens)
    M, S = int(computed_tokens), int(prefix_hit_tokens)
    counters = {
        "prefill": check_int("prefill_first_block", prefill_first_block, minimum=0, error=RequestError),
        "decode": check_int("decode_first_block", decode_first_block, minimum=0, error=RequestError),
    }
    groups: list[GroupRequest] = []
    for gi, lst in enumerate(listings):
        sides: dict[str, SideBlocks] = {}
        for k, side_name in enumerate(("prefill", "decode")):
            count = 1 if lst is None else lst[k].count
            _fits(pair, gi, side_name, counters[side_name], count)
            if lst is None:
                sides[side_name] = StateSlots.running(counters[side_name], M)
            else:
                sides[side_name] = BlockList.consecutive(counters[side_name], count, lst[k].first_token)
            counters[side_name] += count
        groups.append(GroupRequest(sides["prefill"], sides["decode"]))
    return Request(M, tuple(groups), S)
