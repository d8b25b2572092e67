"""One request: per group, each side's block ids and the token position they start at.

Alignment is by token position, never by counting list entries::

    D logical blocks (B_d = 24 tok)   first_token = 0    [ 7 ][ 3 ]          tokens [0, 48)
    P logical blocks (B_p = 16 tok)   first_token = 0    [ 2 ][ 9 ][ 4 ]     tokens [0, 48)
    token 30 lives in D block 3 (30 // 24 = 1 -> ids[1]) and in P block 9 (30 // 16 = 1 -> ids[1])

P computed tokens ``[0, M)``; D already holds ``[0, S)`` (a prefix-cache hit on a D logical block
boundary). A sliding-window group lists only its tail window, so its ``first_token`` differs per
side. A state group lists state slots with the number of tokens each slot's state has absorbed
(usually one slot per side, the running state after ``M`` tokens).

Every listing must cover what its side needs (:mod:`kvgeom.values.coverage`, checked with the
pair): P ``[window start, M)`` and D ``[max(S, window start), M)``. A transfer that moves only part
of the request on purpose says so with ``Request(..., partial=True)``.

Worked number: M = 40, D lists 24-token blocks from token 24 (a prefix hit S = 24): D needs
tokens [24, 40), 16 tokens, all inside its first listed block.
"""

from __future__ import annotations

from typing import Any, Union

import attrs
import numpy as np

from ..errors import RequestError, value_text
from .fields import MAX_INT, as_int, as_tuple, check_int, is_int
from .model import MAX_GROUPS
from .text import format_ids, html_block, html_table, text_table

__all__ = ["MAX_LISTED", "BlockList", "StateSlots", "SideBlocks", "GroupRequest", "Request", "request_repr",
           "request_html", "ListingShape", "RequestShape"]

MAX_LISTED = 1 << 24  # block ids (or slots) one listing may hold: 16M blocks is 268M tokens at 16 per block


def _int_tuple(path: str, value: Any) -> tuple[Any, ...]:
    """The listing as a tuple: Python ints where the entries are integers (numpy ones converted),
    anything else kept for :func:`_check_ids` to refuse with its index."""
    if isinstance(value, np.ndarray) and value.ndim == 1 and value.dtype.kind in "iu" and value.size <= MAX_LISTED:
        return tuple(value.tolist())
    items = as_tuple(value, path, RequestError, max_len=MAX_LISTED)
    return tuple(int(v) if is_int(v) else v for v in items)


def _block_ids(value: Any) -> tuple[int, ...]:
    return _int_tuple("BlockList.block_ids", value)


def _slot_ids(value: Any) -> tuple[int, ...]:
    return _int_tuple("StateSlots.slot_ids", value)


def _tokens(value: Any) -> tuple[int, ...]:
    return _int_tuple("StateSlots.tokens", value)


def _check_ids(path: str, ids: tuple[Any, ...]) -> None:
    if not all(type(b) is int for b in ids) or (ids and (min(ids) < 0 or max(ids) > MAX_INT)):
        for i, b in enumerate(ids):
            check_int(f"{path}[{i}]", b, minimum=0, error=RequestError)
    if len(set(ids)) != len(ids):
        seen: set[int] = set()
        dup = next(b for b in ids if b in seen or seen.add(b))  # type: ignore[func-returns-value]
        raise RequestError(path, f"block id {dup} is listed twice", actual=ids,
                           expected="distinct block ids", fix="list every block once")


@attrs.frozen
class BlockList:
    """An attention group's logical block ids on one side, in token order, from ``first_token``."""

    block_ids: tuple[int, ...] = attrs.field(converter=_block_ids)
    first_token: int = attrs.field(default=0, converter=as_int)

    def __attrs_post_init__(self) -> None:
        _check_ids("BlockList.block_ids", self.block_ids)
        check_int("BlockList.first_token", self.first_token, minimum=0, error=RequestError)

    def token_range(self, block_tokens: int) -> tuple[int, int]:
        """Tokens ``[first, end)`` the listed blocks cover at ``block_tokens`` per block."""
        return self.first_token, self.first_token + len(self.block_ids) * block_tokens

    @classmethod
    def consecutive(cls, first_id: int, count: int, first_token: int = 0) -> BlockList:
        """``count`` fresh consecutive ids starting at ``first_id`` (``count`` is checked before any id is made)."""
        first_id = check_int("BlockList.consecutive.first_id", first_id, minimum=0, error=RequestError)
        count = check_int("BlockList.consecutive.count", count, minimum=0, error=RequestError)
        if count > MAX_LISTED:
            raise RequestError("BlockList.block_ids", f"{count} blocks exceed the {MAX_LISTED} one listing may hold",
                               actual=count, expected=f"<= {MAX_LISTED}",
                               fix="request fewer tokens (or use larger logical blocks)")
        return cls(tuple(range(first_id, first_id + count)), first_token)


@attrs.frozen
class StateSlots:
    """A state group's slots on one side and the tokens each slot's state has absorbed."""

    slot_ids: tuple[int, ...] = attrs.field(converter=_slot_ids)
    tokens: tuple[int, ...] = attrs.field(converter=_tokens)

    def __attrs_post_init__(self) -> None:
        _check_ids("StateSlots.slot_ids", self.slot_ids)
        if len(self.tokens) != len(self.slot_ids):
            raise RequestError("StateSlots.tokens", f"{len(self.tokens)} token counts for "
                               f"{len(self.slot_ids)} slots", actual=self.tokens,
                               expected=f"{len(self.slot_ids)} entries", fix="give one token count per slot")
        for i, t in enumerate(self.tokens):
            check_int(f"StateSlots.tokens[{i}]", t, minimum=0, error=RequestError)
        if len(set(self.tokens)) != len(self.tokens):
            raise RequestError("StateSlots.tokens", "two slots claim the same token position",
                               actual=self.tokens, fix="one slot per token position")

    @classmethod
    def running(cls, slot_id: int, tokens: int) -> StateSlots:
        """The usual listing: one slot holding the running state after ``tokens`` tokens."""
        return cls((slot_id,), (tokens,))


SideBlocks = Union[BlockList, StateSlots]


@attrs.frozen
class GroupRequest:
    """One group's listing on both sides."""

    prefill: SideBlocks
    decode: SideBlocks

    def __attrs_post_init__(self) -> None:
        if type(self.prefill) is not type(self.decode) or not isinstance(self.prefill, (BlockList, StateSlots)):
            raise RequestError("GroupRequest", "both sides must list the same kind of blocks (a BlockList or StateSlots) "
                               f"(got {type(self.prefill).__name__} and {type(self.decode).__name__})",
                               actual=(type(self.prefill).__name__, type(self.decode).__name__),
                               expected="BlockList for attention groups, StateSlots for state groups")


def _group_requests(value: Any) -> tuple[GroupRequest, ...]:
    return as_tuple(value, "Request.groups", RequestError, max_len=MAX_GROUPS)


def _partial_is_bool(instance: Any, attribute: Any, value: Any) -> None:
    if not isinstance(value, bool):
        raise RequestError("Request.partial", f"must be a bool, got {type(value).__name__} {value!r}",
                           actual=value, expected="True or False", fix="pass partial=True or partial=False")


@attrs.frozen(repr=False)
class Request:
    """The whole request: ``M`` computed tokens, ``S`` prefix-hit tokens, one listing per group.

    ``groups`` follows the model's group order. ``partial`` (keyword only, default False) marks a
    transfer that moves part of the request on purpose: its listings need not cover what each side
    needs (docs/design.md §3.4); without it a short, long or misplaced listing is a
    :class:`~kvgeom.errors.RequestError` when the request is checked against a pair.
    """

    computed_tokens: int = attrs.field(converter=as_int)
    groups: tuple[GroupRequest, ...] = attrs.field(converter=_group_requests)
    prefix_hit_tokens: int = attrs.field(default=0, converter=as_int)
    partial: bool = attrs.field(default=False, kw_only=True, validator=_partial_is_bool)

    def __attrs_post_init__(self) -> None:
        check_int("Request.computed_tokens", self.computed_tokens, minimum=0, error=RequestError)
        check_int("Request.prefix_hit_tokens", self.prefix_hit_tokens, minimum=0, error=RequestError)
        if not is_int(self.computed_tokens) or self.prefix_hit_tokens > self.computed_tokens:
            raise RequestError("Request.prefix_hit_tokens", f"S={self.prefix_hit_tokens} exceeds "
                               f"M={self.computed_tokens}", actual=self.prefix_hit_tokens,
                               expected=f"<= {self.computed_tokens}", fix="a prefix hit cannot exceed the prompt")
        for i, g in enumerate(self.groups):
            if not isinstance(g, GroupRequest):
                raise RequestError(f"Request.groups[{i}]", f"expected GroupRequest, got {type(g).__name__}",
                                   actual=value_text(g, 60), fix="wrap each group's two listings in GroupRequest(p, d)")

    @property
    def M(self) -> int:  # noqa: N802 - the design's name
        return self.computed_tokens

    @property
    def S(self) -> int:  # noqa: N802 - the design's name
        return self.prefix_hit_tokens

    def __repr__(self) -> str:
        return request_repr(self)

    def _repr_html_(self) -> str:
        return request_html(self)


# ---- shapes: what the work budget needs of a request --------------------------------------------------


@attrs.frozen
class ListingShape:
    """One side's listing of one group by size only: from ``first_token``, ``count`` blocks (attention)
    or slots (state). What the planner's work estimate needs (docs/design.md §14), without the ids."""

    first_token: int = attrs.field(converter=as_int)
    count: int = attrs.field(converter=as_int)

    def __attrs_post_init__(self) -> None:
        check_int("ListingShape.first_token", self.first_token, minimum=0, error=RequestError)
        check_int("ListingShape.count", self.count, minimum=0, error=RequestError)


def _shape_groups(value: Any) -> tuple[tuple[ListingShape, ListingShape], ...]:
    """attrs converter: per group a (prefill, decode) pair of :class:`ListingShape`, checked here
    (a shape may come from a caller, not only from :meth:`RequestShape.of`)."""
    if not isinstance(value, (tuple, list)):
        raise RequestError("RequestShape.groups", f"expected a tuple of (prefill, decode) ListingShape pairs, got "
                           f"{type(value).__name__}", actual=value_text(value, 60), expected="tuple",
                           fix="use RequestShape.of(request) or kvgeom.building.fresh_shape")
    if len(value) > MAX_GROUPS:
        raise RequestError("RequestShape.groups", f"{len(value)} groups, at most {MAX_GROUPS}", actual=len(value),
                           expected=f"<= {MAX_GROUPS}", fix="list one pair per group of the model")
    out = []
    for i, g in enumerate(value):
        if (not isinstance(g, (tuple, list)) or len(g) != 2
                or not all(isinstance(x, ListingShape) for x in g)):
            raise RequestError(f"RequestShape.groups[{i}]", "expected a (prefill, decode) pair of ListingShape",
                               actual=value_text(g, 60), expected="(ListingShape, ListingShape)",
                               fix="use RequestShape.of(request) or kvgeom.building.fresh_shape")
        out.append((g[0], g[1]))
    return tuple(out)


def _state_pairs(value: Any) -> tuple[int | None, ...]:
    """attrs converter: per group the paired state slots (an int >= 0) or None."""
    if not isinstance(value, (tuple, list)) or len(value) > MAX_GROUPS:
        raise RequestError("RequestShape.state_pairs", "expected a tuple of ints or None, one per group",
                           actual=value_text(value, 60), expected="tuple", fix="leave it out, or use RequestShape.of")
    return tuple(None if v is None else check_int(f"RequestShape.state_pairs[{i}]", v, minimum=0, error=RequestError)
                 for i, v in enumerate(value))


@attrs.frozen
class RequestShape:
    """A request by size only: M, S and per group the (prefill, decode) :class:`ListingShape`.

    :meth:`of` takes it from a request; :func:`kvgeom.building.requests.fresh_shape` computes the
    shape of a fresh request without building its (possibly huge) block lists.

    ``state_pairs`` gives, per group, how many D slots pair with a P slot (``None`` when unknown:
    the estimate then assumes every D slot pairs).
    """

    computed_tokens: int = attrs.field(converter=as_int)
    prefix_hit_tokens: int = attrs.field(converter=as_int)
    groups: tuple[tuple[ListingShape, ListingShape], ...] = attrs.field(converter=_shape_groups)
    state_pairs: tuple[int | None, ...] = attrs.field(default=(), converter=_state_pairs)

    def __attrs_post_init__(self) -> None:
        check_int("RequestShape.computed_tokens", self.computed_tokens, minimum=0, error=RequestError)
        check_int("RequestShape.prefix_hit_tokens", self.prefix_hit_tokens, minimum=0, error=RequestError)

    @classmethod
    def of(cls, request: Request) -> RequestShape:
        groups = []
        pairs: list[int | None] = []
        for g in request.groups:
            sides = []
            for side in (g.prefill, g.decode):
                if isinstance(side, BlockList):
                    sides.append(ListingShape(side.first_token, len(side.block_ids)))
                else:
                    sides.append(ListingShape(0, len(side.slot_ids)))
            groups.append((sides[0], sides[1]))
            if isinstance(g.decode, StateSlots) and isinstance(g.prefill, StateSlots):
                pairs.append(len(set(g.decode.tokens) & set(g.prefill.tokens)))
            else:
                pairs.append(None)
        return cls(request.computed_tokens, request.prefix_hit_tokens, tuple(groups), tuple(pairs))


# ---- text and HTML ----------------------------------------------------------------------------------

def _request_rows(r: Request, pair: Any = None) -> list[list[Any]]:
    names = [g.name for g in pair.model.groups] if pair is not None else [f"g{i}" for i in range(len(r.groups))]
    rows: list[list[Any]] = [["group", "side", "ids", "count", "tokens"]]
    for gi, gr in enumerate(r.groups):
        for side in ("prefill", "decode"):
            listing = getattr(gr, side)
            name = names[gi] if gi < len(names) else f"g{gi}"
            if isinstance(listing, BlockList):
                if pair is not None:
                    lo, hi = listing.token_range(pair.side(side).logical_block_tokens)
                    tokens = f"[{lo}, {hi})"
                else:
                    tokens = f"from {listing.first_token}"
                rows.append([name, side, format_ids(listing.block_ids), len(listing.block_ids), tokens])
            elif isinstance(listing, StateSlots):
                rows.append([name, side, "slots " + format_ids(listing.slot_ids), len(listing.slot_ids),
                             "state after " + ", ".join(str(t) for t in listing.tokens)])
    return rows


def _request_title(r: Request) -> str:
    n = len(r.groups)
    return (f"Request: M={r.computed_tokens} computed tokens, S={r.prefix_hit_tokens} prefix-hit tokens, "
            f"{n} group{'s' if n != 1 else ''}" + (" (partial on purpose)" if r.partial else ""))


def request_repr(r: Request, pair: Any = None) -> str:
    """The request as a table; with ``pair`` the groups are named and token ranges are exact."""
    return _request_title(r) + "\n" + text_table(_request_rows(r, pair))


def request_html(r: Request, pair: Any = None) -> str:
    return html_block(_request_title(r), [], [html_table(_request_rows(r, pair))])
