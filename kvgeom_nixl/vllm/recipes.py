"""Pull recipes: D's planning and lowering of a request done once per request shape (docs/design.md §15.4).

A serving engine's requests repeat their shape: the same token counts, and block lists that differ
only by where the allocator started them. Planning checks the request and the plan at every layer
(the block tables, the request, the budget, the plan's columns, the rows against the regions) and
builds the same objects each time; for a shape seen before, this module gives the rows this D rank
posts from the learnt ones, each offset moved by the shift of its side's block ids (numpy, one
multiply-add per column), with no planning::

    shape   (tokens planned, prefix hit S, decode tokens N, P's list lengths,
             P's lists from the first block past S and D's lists, each
             side's as ids minus that side's smallest id)                 -> the key
    recipe  this rank's rows at the learnt ids, per P rank (d_region, d_offset, p_region, p_offset,
            nbytes); per row the bytes one id of shift moves its P and its D offset; the consumers
            per P rank; D's writable blocks; how far each side's ids may shift (inside its pool)
    apply   every id a Python int, the shift inside the pool   -> rows + shift x step, blocks + shift
            anything else                                      -> None: the caller plans (and the
                                                                  planner's checks name what is wrong)

Why the shifted rows are the plan of the shifted request: a region's logical blocks are one strided
dimension, so moving every id of one side by ``k`` moves every byte of that side's blocks by ``k``
times its region's block stride; the request keeps its relative pattern, so the planner builds the
same rows in the same order (coalescing merges rows adjacent on both sides within one region pair,
and a shift that is uniform per region keeps adjacency). P's blocks wholly inside D's prefix hit
(the first S // P's block tokens of each full-attention list, which starts at token 0) are never
read, since D holds those tokens: they are left out of the shape (on a 1-block hit after 4096
tokens, 1 id of P's 129 is made relative, not 129) and out of the probes, and a pull from a recipe
never looks at them; a window's list, placed by its end (vLLM clips it), is keyed whole. Each
recipe is checked before it is kept: two probe plans (the ids of one side + 1) measure every row's step, and a recipe is refused when
rows of one region disagree, when the probe changes anything but the shifted side's offsets, or
when it does not reproduce, row for row, the plan of the earlier request of the same shape (a
shape is learnt on its second request, so a shape seen once costs no probes). Only plans of copies
alone are learnt (no zeros, no rearranges, not packed) on models of attention groups only, and ids
stay in [1, pool): the null block 0, which a window's list may carry, is never shifted to.

Every posted row is still checked inside both ranks' regions (:meth:`~kvgeom_nixl.Link.post_pull`),
and the P ids a pull reads, which cross the proxy, are bounded by P's pool here before any row is
built (the ids inside the hit are not read, so a recipe does not check them; the planner, which a
shape's first two requests go through, checks every id).

Worked number: a 4096-token prompt into 128 fresh blocks of 32 tokens (tiny Llama, 2 layers, TP1)
plans to 2 rows (one per layer: the blocks are consecutive on both sides); the next such prompt
with P's blocks from id 300 and D's from 17 posts those 2 rows with P offsets + (300 - p_base) x
the P page bytes and D offsets + (17 - d_base) x the D page bytes.
"""

from __future__ import annotations

import collections
import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from kvgeom import AttentionSpec, BlockList, CostModel, GroupRequest, KvGeomError, Request, TransferPlan
from kvgeom_nixl.endpoint import Link

__all__ = ["PullRecipes", "Shape", "Applied", "MAX_RECIPES", "MAX_ROWS"]

MAX_RECIPES = 64  # shapes kept per link (least recently used dropped), learnt or refused
MAX_ROWS = 1 << 12  # rows of this rank a recipe may keep (<= 7 int64 columns: ~230 KB; larger plans are planned)
_FIRST_ID = 1  # the lowest id a shifted list may hold (0 is vLLM's null block)

Reads = dict[int, tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]]


@dataclass(frozen=True)
class Shape:
    """One request's shape (``key``) and where its lists start on each side."""

    key: tuple[object, ...]
    p_base: int
    d_base: int
    p_span: int  # the largest relative id on each side (its lists fit in [base, base + span])
    d_span: int


@dataclass(frozen=True)
class Applied:
    """What :meth:`~kvgeom_nixl.Link.post_pull` takes: rows per P rank, consumers per P rank, D's
    writable blocks per group."""

    reads: Reads
    consumers: dict[int, int]
    invalid_blocks: dict[int, tuple[int, ...]]


@dataclass(frozen=True)
class _Recipe:
    p_base: int
    d_base: int
    p_max: int  # the largest base each side may shift to (its last id stays below the pool)
    d_max: int
    reads: Reads
    p_step: dict[int, np.ndarray]
    d_step: dict[int, np.ndarray]
    consumers: dict[int, int]
    writable: dict[int, tuple[int, ...]]


@dataclass(frozen=True)
class _Seen:
    """A shape's first request: what a recipe learnt on the second must reproduce."""

    shape: Shape
    applied: Applied


def _relative(lists: Sequence[Sequence[int]]) -> tuple[int, int, tuple[object, ...]] | None:
    """(smallest id, largest relative id, each list relative to the smallest id), or None when an
    id is not a Python int (the planner then refuses it by name). A list of consecutive ids is
    written ``("run", first, count)``, any other as its relative ids."""
    ids = list(itertools.chain.from_iterable(lists))
    if not ids:
        return 0, 0, tuple(() for _ in lists)
    if not set(map(type, ids)) <= {int}:
        return None
    base, top = min(ids), max(ids)
    out: list[object] = []
    for one in lists:
        one = tuple(one)
        n = len(one)
        if n and one[-1] - one[0] == n - 1 and one == tuple(range(one[0], one[0] + n)):
            out.append(("run", one[0] - base, n))
        else:
            out.append(tuple(x - base for x in one))
    return base, top - base, tuple(out)


def _rows(plan: TransferPlan, rank: int) -> Reads:
    """This D rank's copies of ``plan`` per P rank, in posting order (int64 columns)."""
    c = plan.copies
    own = np.flatnonzero(c.d_rank == rank)
    out: Reads = {}
    for p in sorted({int(x) for x in c.p_rank[own]}):
        rows = own[c.p_rank[own] == p]
        out[p] = tuple(np.ascontiguousarray(col[rows], dtype=np.int64)  # type: ignore[assignment]
                       for col in (c.d_region, c.d_offset, c.p_region, c.p_offset, c.nbytes))
    return out


def _same(a: Reads, b: Reads) -> bool:
    return a.keys() == b.keys() and all(np.array_equal(x, y) for p in a for x, y in zip(a[p], b[p]))


def _step(base: Reads, moved: Reads, offset: int) -> dict[int, np.ndarray] | None:
    """Per P rank, each row's change of column ``offset`` (1: D, 3: P) between ``base`` and
    ``moved``, or None unless every other column is unchanged and the rows of one region change alike."""
    if base.keys() != moved.keys():
        return None
    out = {}
    for p in base:
        if any(len(x) != len(y) for x, y in zip(base[p], moved[p])):
            return None
        if not all(np.array_equal(base[p][i], moved[p][i]) for i in range(5) if i != offset):
            return None
        step = moved[p][offset] - base[p][offset]
        region = base[p][offset - 1]
        for r in np.unique(region):
            s = step[region == r]
            if not np.all(s == s[0]) or s[0] < 0:
                return None
        out[p] = step
    return out


class PullRecipes:
    """The recipes of one link (one P engine): :meth:`shape`, :meth:`apply`, :meth:`learn`.

    Used by one thread (the executor's jobs thread); planning for the probes holds the link's lock
    as :meth:`Link.plan` does."""

    def __init__(self, link: Link, strategy: str, rank: int, cost_model: CostModel | None = None) -> None:
        self.link = link
        self.strategy = strategy
        self.rank = rank
        self.cost_model = cost_model  # (the pulls' own: a probe plans as they do)
        pair = link.pair
        self._attention_only = all(isinstance(g, AttentionSpec) for g in pair.model.groups)
        self._p_block_tokens = pair.prefill.logical_block_tokens
        # groups whose P list starts at token 0 (no window): their blocks inside the hit are left out
        # of the key; a window's list is placed by its end (clipped, or led by null blocks) and
        # keyed whole (it is short: the window's blocks)
        self._from_zero = tuple(isinstance(g, AttentionSpec) and g.window_tokens is None for g in pair.model.groups)
        self._pool = {side: min((pair.side(side).num_logical_blocks(r) for gi in range(len(pair.model.groups))
                                 for r in pair.side(side).group_regions(gi)), default=0)
                      for side in ("prefill", "decode")}
        self._recipes: collections.OrderedDict[tuple[object, ...], _Recipe | _Seen | None] = collections.OrderedDict()
        self.counts = collections.Counter[str]()  # applied, learnt, refused, seen

    def shape(self, tokens: int, prefix_hit_tokens: int, decode_tokens: int, remote: Sequence[Sequence[int]],
              local: Sequence[Sequence[int]]) -> Shape | None:
        """The request's shape, or None when no recipe can apply (a model with state groups, an id
        that is not an int)."""
        if not self._attention_only or len(remote) != len(self._from_zero):
            return None
        skip = prefix_hit_tokens // self._p_block_tokens  # P's blocks wholly inside the hit: never read
        p = _relative([one[skip:] if zero else one for one, zero in zip(remote, self._from_zero)] if skip else remote)
        d = _relative(local)
        if p is None or d is None:
            return None
        lengths = tuple(len(one) for one in remote)
        return Shape((tokens, prefix_hit_tokens, decode_tokens, lengths, p[2], d[2]), p[0], d[0], p[1], d[1])

    def apply(self, shape: Shape) -> Applied | None:
        """The rows of a request of ``shape`` from its recipe, or None (no recipe yet, or an id
        outside [1, pool) after the shift: the caller plans)."""
        r = self._recipes.get(shape.key)
        if not isinstance(r, _Recipe):
            return None
        if not (_FIRST_ID <= shape.p_base <= r.p_max and _FIRST_ID <= shape.d_base <= r.d_max):
            return None
        self._recipes.move_to_end(shape.key)
        self.counts["applied"] += 1
        return _shifted(r, shape.p_base - r.p_base, shape.d_base - r.d_base)

    def learn(self, shape: Shape, request: Request, plan: TransferPlan, consumers: dict[int, int],
              invalid_blocks: dict[int, tuple[int, ...]]) -> None:
        """After the planned pull of a request of ``shape``: keep what it posted (its first request),
        or (its second) learn the recipe and check it; see the module docstring."""
        key = shape.key
        old = self._recipes.get(key, None)
        if isinstance(old, _Recipe) or (key in self._recipes and old is None):
            return
        part = plan.for_decode_rank(self.rank)
        if plan.packed or len(part.zeros) or part.rearranges or len(part.copies) > MAX_ROWS:
            self._keep(key, None, "refused")
            return
        applied = Applied(_rows(part, self.rank), dict(consumers), {g: tuple(ids) for g, ids in invalid_blocks.items()})
        if old is None:
            self._keep(key, _Seen(shape, applied), "seen")
            return
        recipe = self._recipe(shape, request, applied)
        first = old.shape
        ok = recipe is not None and (
            first.p_base <= recipe.p_max and first.d_base <= recipe.d_max
            and _equal(_shifted(recipe, first.p_base - recipe.p_base, first.d_base - recipe.d_base), old.applied))
        self._keep(key, recipe if ok else None, "learnt" if ok else "refused")

    def _keep(self, key: tuple[object, ...], value: _Recipe | _Seen | None, what: str) -> None:
        self._recipes[key] = value
        self._recipes.move_to_end(key)
        while len(self._recipes) > MAX_RECIPES:
            self._recipes.popitem(last=False)
        self.counts[what] += 1

    def _recipe(self, shape: Shape, request: Request, applied: Applied) -> _Recipe | None:
        p_max = self._pool["prefill"] - 1 - shape.p_span
        d_max = self._pool["decode"] - 1 - shape.d_span
        if shape.p_base < _FIRST_ID or shape.d_base < _FIRST_ID or shape.p_base + 1 > p_max \
                or shape.d_base + 1 > d_max:
            return None
        p_moved, d_moved = self._probe(request, 1, 0), self._probe(request, 0, 1)
        if p_moved is None or d_moved is None:
            return None
        p_step, d_step = _step(applied.reads, p_moved, 3), _step(applied.reads, d_moved, 1)
        if p_step is None or d_step is None:
            return None
        return _Recipe(shape.p_base, shape.d_base, p_max, d_max, applied.reads, p_step, d_step, applied.consumers,
                       applied.invalid_blocks)

    def _probe(self, request: Request, dp: int, dd: int) -> Reads | None:
        """This rank's rows for ``request`` with P's ids past the hit + ``dp`` and D's + ``dd`` (planned)."""
        hit_blocks = request.prefix_hit_tokens // self._p_block_tokens
        try:
            groups = []
            for g, zero in zip(request.groups, self._from_zero):
                p, d = g.prefill, g.decode
                if not isinstance(p, BlockList) or not isinstance(d, BlockList):
                    return None
                # (the ids shape() leaves out: a full-attention list's blocks inside the hit)
                keep = max(0, hit_blocks - p.first_token // self._p_block_tokens) if zero else 0
                p_ids = p.block_ids[:keep] + tuple(b + dp for b in p.block_ids[keep:])
                groups.append(GroupRequest(BlockList(p_ids, p.first_token),
                                           BlockList(tuple(b + dd for b in d.block_ids), d.first_token)))
            moved = Request(request.computed_tokens, tuple(groups), request.prefix_hit_tokens, partial=request.partial)
            plan = self.link.plan(moved, strategy=self.strategy, cost_model=self.cost_model)
        except KvGeomError:
            return None
        part = plan.for_decode_rank(self.rank)
        if plan.packed or len(part.zeros) or part.rearranges:
            return None
        return _rows(part, self.rank)


def _shifted(r: _Recipe, dp: int, dd: int) -> Applied:
    reads: Reads = {}
    for p, (d_region, d_offset, p_region, p_offset, nbytes) in r.reads.items():
        reads[p] = (d_region, d_offset + dd * r.d_step[p] if dd else d_offset, p_region,
                    p_offset + dp * r.p_step[p] if dp else p_offset, nbytes)
    writable = {g: tuple(b + dd for b in ids) for g, ids in r.writable.items()} if dd else r.writable
    return Applied(reads, r.consumers, writable)


def _equal(a: Applied, b: Applied) -> bool:
    return _same(a.reads, b.reads) and a.consumers == b.consumers and a.invalid_blocks == b.invalid_blocks
