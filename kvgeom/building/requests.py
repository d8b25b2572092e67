"""Requests built from a few numbers: fresh consecutive blocks on both sides (the CLI's default).

P lists blocks for ``[0, M)``; D lists blocks for ``[S, N)``. Sliding groups list only the blocks
from the window's start (``kvgeom.arith.tokens.window_start(M, W)``, the one rule) on each side;
state groups list one running state::

    M = 40, S = 16, B_p = 16, B_d = 8      P: ids 0 1 2 from token 0     (tokens [0, 48))
                                           D: ids 0 1 2 from token 16    (tokens [16, 40))

Worked number: the example above lists ``ceil_div(40, 16) = 3`` P blocks and
``ceil_div(40 - 16, 8) = 3`` D blocks.
"""

from __future__ import annotations

from ..arith.ints import ceil_div
from ..arith.tokens import window_start
from ..values.model import AttentionSpec, StateSpec
from ..values.pair import EnginePair
from ..values.request import BlockList, GroupRequest, Request, SideBlocks, StateSlots

__all__ = ["fresh_request", "fresh_span"]


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


def fresh_request(
    pair: EnginePair,
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
    that share a region never share a block.
    """
    M, S = computed_tokens, prefix_hit_tokens
    N = M if decode_tokens is None else decode_tokens
    counters = {"prefill": prefill_first_block, "decode": decode_first_block}
    groups: list[GroupRequest] = []
    for spec in pair.model.groups:
        sides: dict[str, SideBlocks] = {}
        for side_name, lo, hi in (("prefill", 0, M), ("decode", S, N)):
            eng = pair.side(side_name)
            B = eng.logical_block_tokens
            if isinstance(spec, StateSpec):
                sides[side_name] = StateSlots.running(counters[side_name], M)
                counters[side_name] += 1
                continue
            first, count = fresh_span(spec, B, M, lo, hi)
            sides[side_name] = BlockList.consecutive(counters[side_name], count, first)
            counters[side_name] += count
        groups.append(GroupRequest(sides["prefill"], sides["decode"]))
    return Request(M, tuple(groups), S)
