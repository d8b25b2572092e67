"""Requests from a scheduler's block tables: per group, the block ids each side lists, in token order
(docs/design.md §10.3).

A connector holds, for one request, one list of logical block ids per KV-cache group and per side
(vLLM: ``remote_block_ids`` from P, ``local_block_ids`` on D, in ``kv_cache_config`` group order).
:func:`request_from_block_tables` turns them into a :class:`~kvgeom.values.request.Request`,
placing every list by token position, and checks that each list covers what its side needs
(:mod:`kvgeom.values.coverage`). Where each list starts, by group kind::

    full attention, MLA   P from token 0            D from S (the blocks D does not hold yet)
    sliding window        the tail of the side's table: its last block holds token M - 1 (P) or
                          N - 1 (D); vLLM clips these lists to their last blocks. Leading
                          ``null_block`` ids (vLLM's block 0 outside the window) are skipped.
                          ``first_tokens={group: (p, d)}`` overrides both.
    state (mamba, GDN)    the last id is the running state, after M tokens on both sides (vLLM's
                          N-1 rule: P prefills M = N - 1 tokens, D receives that state and
                          recomputes token N itself); earlier ids (``mamba_cache_mode="all"``)
                          hold the states at the side's preceding block boundaries.
                          ``state_tokens={group: (p, d)}`` overrides both.

``N`` is ``decode_tokens`` (default ``M``; hybrids allocate ``M + 1``).

Worked number: 16-token blocks on both sides, M = 50, P lists [1, 2]: the list covers tokens
[0, 32) of the [0, 50) P must cover, so the call raises ``RequestError`` naming group, side,
``[0, 32)`` and ``[0, 50)``; [1, 2, 3, 4] covers [0, 64) and passes.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from ..arith.ints import MAX_INT, ceil_div
from ..errors import IncompatibleGeometry, RequestError, value_text
from ..values.fields import check_instance, check_int, check_str
from ..values.model import AttentionSpec
from ..values.pair import CheckedEngines
from ..values.request import MAX_LISTED, BlockList, GroupRequest, Request, SideBlocks, StateSlots

__all__ = ["request_from_block_tables", "state_slot_tokens"]

_SIDES = ("prefill", "decode")


def state_slot_tokens(count: int, block_tokens: int, computed_tokens: int) -> tuple[int, ...]:
    """vLLM's convention for the tokens each listed state slot holds: the last slot is the running
    state after ``M`` tokens; each earlier one the state at the end of the block before.

    >>> state_slot_tokens(1, 16, 50), state_slot_tokens(3, 16, 50)
    ((50,), (32, 48, 50))
    """
    if count <= 0:
        return ()
    last = max(0, ceil_div(computed_tokens, block_tokens) - 1)  # index of the block holding token M - 1
    blocks = range(last - count + 1, last + 1)
    if blocks.start < 0:
        raise RequestError("state slots", f"{count} state slots for M={computed_tokens} with {block_tokens}-token "
                           f"blocks: only {last + 1} block(s) end at or before M", actual=count,
                           expected=f"<= {last + 1}", fix="list at most one slot per block up to M")
    return tuple(min((j + 1) * block_tokens, computed_tokens) for j in blocks)


def _too_many(path: str, n: int, limit: int, pool: str) -> RequestError:
    return RequestError(path, f"{value_text(n)} ids exceed {pool}", actual=n, expected=f"<= {limit} ids",
                        fix="list each block of the request once (are these the request's block ids?)")


def _ids(path: str, value: Any, limit: int, pool: str) -> list[int]:
    """``value``'s ids as Python ints: its length is checked against ``limit`` before any id is read,
    a numpy integer array is checked in one vectorised pass."""
    if isinstance(value, np.ndarray):
        if value.ndim != 1:
            raise RequestError(path, f"expected a list of block ids, got an array of shape {value.shape}",
                               actual=value.shape, expected="a one-dimensional sequence of ints",
                               fix="pass one list of block ids per group")
        if value.size > limit:
            raise _too_many(path, int(value.size), limit, pool)
        if value.dtype.kind in "iu":
            bad = np.flatnonzero((value < 0) | (value > MAX_INT))
            if bad.size:
                i = int(bad[0])
                check_int(f"{path}[{i}]", value[i], minimum=0, error=RequestError)  # raises, naming the id
            return [int(v) for v in value.tolist()]
        value = value.tolist()  # floats, bools, objects: each id checked below (at most ``limit``)
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
        raise RequestError(path, f"expected a list of block ids, got {type(value).__name__}",
                           actual=value_text(value, 60), expected="a sequence of ints",
                           fix="pass one list of block ids per group")
    if len(value) > limit:
        raise _too_many(path, len(value), limit, pool)
    if isinstance(value, (list, tuple)) and all(type(v) is int for v in value) and (
            not value or (min(value) >= 0 and max(value) <= MAX_INT)):
        return list(value)  # plain ints in range: one pass each for type, min and max
    out: list[int] = []
    for i, v in enumerate(value):
        if i >= limit:  # a sequence whose len() understated its items
            raise _too_many(path, i + 1, limit, pool)
        out.append(check_int(f"{path}[{i}]", v, minimum=0, error=RequestError))
    return out


def _pair_of(path: str, value: Any) -> tuple[Any, Any]:
    if isinstance(value, np.ndarray) and value.ndim == 1 and value.dtype.kind in "iu":
        value = value.tolist()
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence) or len(value) != 2:
        raise RequestError(path, "expected a (prefill, decode) pair", actual=value_text(value, 60),
                           expected="(prefill, decode)", fix="give one value per side, prefill first")
    return value[0], value[1]


def _overrides(label: str, mapping: Any, names: list[str]) -> Mapping[str, Any]:
    """``first_tokens`` / ``state_tokens``: a mapping from group names, checked before any value is read."""
    if mapping is None:
        return {}
    if not isinstance(mapping, Mapping):
        raise RequestError(label, f"expected a mapping of group name to (prefill, decode), got "
                           f"{type(mapping).__name__} {value_text(mapping, 60)}", actual=value_text(mapping, 60),
                           expected="{group name: (prefill, decode)}", fix=f"pass e.g. {{{names[0]!r}: (0, 0)}}"
                           if names else "pass a dict keyed by group name")
    if len(mapping) > len(names):
        raise RequestError(label, f"{value_text(len(mapping))} overrides for a model of {len(names)} groups",
                           actual=len(mapping), expected=f"<= {len(names)}", fix="key the overrides by group name")
    for key in mapping:
        check_str(f"{label} key", key, error=RequestError)
    unknown = sorted(set(mapping) - set(names))
    if unknown:
        raise RequestError(label, f"no group named {unknown[0]!r}", actual=unknown, expected=names,
                           fix="key the overrides by the model's group names")
    return mapping


def request_from_block_tables(
    pair: CheckedEngines,
    computed_tokens: int,
    prefill_blocks: Sequence[Sequence[int]],
    decode_blocks: Sequence[Sequence[int]],
    *,
    prefix_hit_tokens: int = 0,
    decode_tokens: int | None = None,
    first_tokens: Mapping[str, Sequence[int]] | None = None,
    state_tokens: Mapping[str, Sequence[Sequence[int]]] | None = None,
    null_block: int | None = None,
    partial: bool = False,
) -> Request:
    """A request from per-group block id lists of both sides, placed by token and checked.

    ``prefill_blocks`` / ``decode_blocks``: one list of logical block ids per model group, in the
    model's group order (vLLM: the ``kv_cache_config`` group order). ``computed_tokens`` is M,
    ``prefix_hit_tokens`` S (on a D block boundary), ``decode_tokens`` N (default M). Where each
    list starts is the module's table; ``first_tokens`` and ``state_tokens`` override it per
    group name, ``null_block`` (vLLM: 0) is skipped at the head of sliding-window lists.

    Raises :class:`~kvgeom.errors.RequestError` for anything
    :meth:`~kvgeom.values.pair.CheckedEngines.check_request` refuses, in particular a list that does
    not cover its side's needed tokens (too short, too long, misplaced), naming the group, the
    side, the tokens listed and the tokens needed. ``partial=True`` accepts such lists on purpose.
    """
    check_instance("pair", pair, CheckedEngines, error=IncompatibleGeometry, fix="build the pair with kvgeom.Pair(P, D)")
    M = check_int("computed_tokens", computed_tokens, minimum=0, error=RequestError)
    S = check_int("prefix_hit_tokens", prefix_hit_tokens, minimum=0, error=RequestError)
    N = M if decode_tokens is None else check_int("decode_tokens", decode_tokens, minimum=M, error=RequestError)
    if null_block is not None:
        null_block = check_int("null_block", null_block, minimum=0, error=RequestError)
    groups = pair.model.groups
    names = [g.name for g in groups]
    firsts = _overrides("first_tokens", first_tokens, names)
    states = _overrides("state_tokens", state_tokens, names)
    tables = {}
    for side, value in (("prefill", prefill_blocks), ("decode", decode_blocks)):
        if isinstance(value, (str, bytes)) or not isinstance(value, Sequence) or len(value) != len(groups):
            got = len(value) if isinstance(value, Sequence) else type(value).__name__
            raise RequestError(f"{side}_blocks", f"{got} block lists for a model with {len(groups)} groups",
                               actual=got, expected=len(groups), fix="pass one list per group, in the model's order")
        eng = pair.side(side)
        lists = []
        for gi, ids in enumerate(value):
            # ids are distinct and inside the group's pool, so no list is longer than the pool (plus the
            # null blocks before a window, at most the side's blocks up to its last token)
            regions = eng.group_regions(gi)
            pool = min((eng.num_logical_blocks(r) for r in regions), default=MAX_LISTED)
            limit, what = min(pool, MAX_LISTED), f"the {pool} logical blocks of {side}'s pool for this group"
            spec = groups[gi]
            if (null_block is not None and isinstance(spec, AttentionSpec) and spec.window_tokens is not None
                    and spec.name not in firsts):
                nulls = ceil_div(M if side == "prefill" else N, eng.logical_block_tokens)
                limit = min(pool + nulls, MAX_LISTED)
                what = f"the {pool} logical blocks of {side}'s pool plus {value_text(nulls)} null blocks"
            if limit == MAX_LISTED:
                what = f"the {MAX_LISTED} one listing may hold"
            lists.append(_ids(f"{side}_blocks[{gi}]({names[gi]})", ids, limit, what))
        tables[side] = lists

    out: list[GroupRequest] = []
    for gi, spec in enumerate(groups):
        listings: dict[str, SideBlocks] = {}
        for si, side in enumerate(_SIDES):
            ids = tables[side][gi]
            B = pair.side(side).logical_block_tokens
            path = f"{side}_blocks[{gi}]({spec.name})"
            if not isinstance(spec, AttentionSpec):
                given = states.get(spec.name)
                if given is not None:
                    where = f"state_tokens[{spec.name!r}]"
                    tokens = tuple(_ids(f"{where}[{si}]", _pair_of(where, given)[si], len(ids),
                                        f"the {len(ids)} slots {side} lists"))
                else:
                    try:
                        tokens = state_slot_tokens(len(ids), B, M)
                    except RequestError as e:
                        raise RequestError(path, e.message, actual=e.actual, expected=e.expected, fix=e.fix) from None
                listings[side] = StateSlots(tuple(ids), tokens)
                continue
            given_first = firsts.get(spec.name)
            if given_first is not None:
                first = check_int(f"first_tokens[{spec.name!r}]", _pair_of(f"first_tokens[{spec.name!r}]",
                                                                           given_first)[si], minimum=0,
                                  error=RequestError)
            elif spec.window_tokens is not None:
                skipped = 0
                while null_block is not None and skipped < len(ids) and ids[skipped] == null_block:
                    skipped += 1
                ids = ids[skipped:]
                end = ceil_div(M if side == "prefill" else N, B)  # blocks up to the side's last token
                first = (end - len(ids)) * B
                if first < 0:
                    raise RequestError(path, f"{len(ids)} blocks of {B} tokens end at the block of token "
                                       f"{(M if side == 'prefill' else N) - 1}, so the list would start before "
                                       "token 0", actual=len(ids), expected=f"<= {end} blocks",
                                       fix="pass first_tokens={group: (prefill, decode)} or list fewer blocks")
            else:
                first = 0 if side == "prefill" else S
            listings[side] = BlockList(tuple(ids), first)
        out.append(GroupRequest(listings["prefill"], listings["decode"]))
    request = Request(M, tuple(out), S, partial=partial)
    pair.check_request(request)
    return request
