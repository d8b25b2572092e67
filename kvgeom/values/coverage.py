"""Coverage: does each side's listing hold exactly the tokens the transfer needs from it?

A truncated block list is a classic connector bug: the planner would move the shorter range, zero
the rest, and the simulator would agree. So every listing is checked against the range its side
must cover (docs/design.md §3.4), by token position, per group::

    P computed        [0 ...................................... M)
    P must cover           [ws ................................ M)     ws = window_start(M, W) (0: full, MLA)
    D must cover                      [max(S, ws) ............. M)     S = D's prefix hit
    a listing         [first, first + len(ids) * B)                    B = that side's logical block

* **too short**: the listing starts after the range it must cover, or ends before ``M``;
* **too long**: its last block lies wholly past what the side holds: on P a block starting at or
  after ``M`` (P computed nothing there), on D a block starting after ``M`` (D allocates up to the
  block of token ``M`` itself, vLLM's ``N = M + 1`` rule for hybrids);
* **misaligned**: a first token off its side's block boundary (checked with the other request
  rules in :meth:`~kvgeom.values.pair.CheckedEngines.check_request`).

A state group must list, on each side, a slot whose state has absorbed ``M`` tokens (vLLM's
running state: P prefilled ``M = N - 1`` tokens, and D receives that state; D's slots may not
claim more than ``M`` tokens). Nothing is needed when ``S == M`` (a full prefix hit). Listing
more blocks before the needed range (held prefix blocks on D, older window blocks on P) is
allowed: they are never written.

A request built on purpose to move part of a request (``Request(..., partial=True)``) skips these
rules; everything else still applies.

Worked number: 16-token blocks, M = 50, no prefix hit; P lists ids [1, 2] from token 0, i.e.
tokens [0, 32). P must cover [0, 50): the listing is 18 tokens short, and the error says
``lists tokens [0, 32), needs [0, 50)`` and to list ``ceil(50 / 16) = 4`` blocks.
"""

from __future__ import annotations

from typing import Protocol

from ..arith.ints import ceil_div
from ..arith.tokens import window_start
from ..errors import RequestError
from .model import AttentionSpec, ModelSpec
from .request import BlockList, Request, StateSlots

__all__ = ["needed_range", "coverage_problems"]


class _Side(Protocol):
    @property
    def logical_block_tokens(self) -> int: ...


def needed_range(spec: AttentionSpec, side: str, computed_tokens: int, prefix_hit_tokens: int) -> tuple[int, int]:
    """Tokens ``[lo, hi)`` side ``side`` ("prefill" or "decode") must list for an attention group.

    >>> from kvgeom.values.model import AttentionSpec
    >>> needed_range(AttentionSpec("swa", "sliding", 1, 1, 8, window_tokens=16), "decode", 100, 32)
    (84, 100)
    """
    ws = window_start(computed_tokens, spec.window_tokens)
    lo = ws if side == "prefill" else max(prefix_hit_tokens, ws)
    return min(lo, computed_tokens), computed_tokens


def _attention_problem(path: str, side: str, listing: BlockList, B: int, lo: int, hi: int,
                       M: int) -> RequestError | None:
    first, end = listing.token_range(B)
    count = len(listing.block_ids)
    wanted_first = lo // B * B
    wanted = max(0, ceil_div(hi - wanted_first, B))
    fix = (f"list the {wanted} {side} block(s) from token {wanted_first} (tokens [{wanted_first}, "
           f"{wanted_first + wanted * B})), or pass Request(..., partial=True) for a partial transfer on purpose")
    listed = f"[{first}, {end})" if count else "nothing"
    if lo < hi and (first > lo or end < hi):
        where = "at the start" if first > lo else "at the end"
        missing = (first - lo) if first > lo else (hi - end)
        return RequestError(path, f"lists tokens {listed} ({count} block(s) of {B}), needs [{lo}, {hi}): "
                            f"too short {where} ({missing} token(s) missing)", actual=(first, end),
                            expected=(lo, hi), fix=fix)
    if count:
        last_start = end - B
        # P computed nothing at or past M; D allocates up to the block holding token M (N = M + 1)
        too_far = last_start >= M if side == "prefill" else last_start > M
        if too_far:
            return RequestError(path, f"lists tokens {listed} ({count} block(s) of {B}), needs [{lo}, {hi}): "
                                f"too long, its last block starts at token {last_start}, past what {side} "
                                f"{'computed' if side == 'prefill' else 'allocates'} for M={M}",
                                actual=(first, end), expected=(lo, hi), fix=fix)
    return None


def _state_problem(path: str, side: str, listing: StateSlots, M: int, S: int) -> RequestError | None:
    if side == "decode" and any(t > M for t in listing.tokens):
        return RequestError(f"{path}.tokens", f"a decode state after {max(listing.tokens)} tokens, but P "
                            f"computed only M={M}", actual=listing.tokens, expected=f"<= {M}",
                            fix="list the slot that receives P's state after M tokens")
    if S < M and M not in listing.tokens:
        return RequestError(f"{path}.tokens", f"lists states after {list(listing.tokens)} tokens, needs the "
                            f"running state after M={M} tokens: too short", actual=listing.tokens,
                            expected=f"a slot with {M} tokens",
                            fix=f"list the running state slot with tokens={M} (vLLM: the group's last block id), "
                                "or pass Request(..., partial=True) for a partial transfer on purpose")
    return None


def coverage_problems(model: ModelSpec, prefill: _Side, decode: _Side, request: Request) -> tuple[RequestError, ...]:
    """Every listing of ``request`` that does not cover what its side needs (empty when all do).

    Ignores ``request.partial`` (the caller decides); listings of the wrong kind are left to
    :meth:`~kvgeom.values.pair.CheckedEngines.check_request`, which reports them first.
    """
    M, S = request.computed_tokens, request.prefix_hit_tokens
    out: list[RequestError] = []
    for gi, (spec, gr) in enumerate(zip(model.groups, request.groups)):
        for side, eng in (("prefill", prefill), ("decode", decode)):
            listing = getattr(gr, side)
            path = f"Request.groups[{gi}]({spec.name}).{side}"
            problem: RequestError | None = None
            if isinstance(spec, AttentionSpec) and isinstance(listing, BlockList):
                lo, hi = needed_range(spec, side, M, S)
                problem = _attention_problem(path, side, listing, eng.logical_block_tokens, lo, hi, M)
            elif isinstance(listing, StateSlots) and not isinstance(spec, AttentionSpec):
                problem = _state_problem(path, side, listing, M, S)
            if problem is not None:
                out.append(problem)
    return tuple(out)
