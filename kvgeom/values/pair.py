"""A prefill/decode pair: the one place that decides whether two engines can exchange KV cache.

``CheckedEngines(prefill, decode)`` (and its planning face ``kvgeom.Pair``) runs :func:`incompatibilities` when built, before any request, and
:func:`pairable` answers the same question without raising, from the same list of rules.

    prefill (P) engine ----- same model facts? ----- decode (D) engine
          TP, K, ppl, layout, PP stages,           dtype, groups, layers, heads, head bytes,
          DCP and replicas may differ              windows, state sections and the global
                                                   layer order may not

Worked number: P with head_bytes 256 and D with head_bytes 128 fail with
``decode.model.groups[0].head_bytes: 128 != prefill's 256``.
"""

from __future__ import annotations

import logging
from typing import Any

import attrs
import numpy as np

from ..errors import IncompatibleGeometry, RequestError, value_text
from .coverage import coverage_problems
from .engine import EngineGeometry
from .fields import check_instance
from .model import AttentionSpec, ModelSpec, StateSpec
from .request import BlockList, Request, StateSlots

__all__ = ["CheckedEngines", "Compatibility", "incompatibilities", "pairable"]

logger = logging.getLogger(__name__)


def incompatibilities(prefill: EngineGeometry, decode: EngineGeometry) -> tuple[IncompatibleGeometry, ...]:
    """Every reason the two engines cannot be paired (empty when they can). The only rule list."""
    out: list[IncompatibleGeometry] = []

    def differ(path: str, p: Any, d: Any, fix: str) -> None:
        if p != d:
            out.append(IncompatibleGeometry(f"decode.model.{path}", f"{d!r} != prefill's {p!r}",
                                            actual=d, expected=p, fix=fix))

    pm, dm = prefill.model, decode.model
    differ("dtype", pm.dtype, dm.dtype, "run both engines with the same KV cache dtype")
    pnames = [g.name for g in pm.groups]
    dnames = [g.name for g in dm.groups]
    if pnames != dnames:
        only_p = [n for n in pnames if n not in dnames]
        only_d = [n for n in dnames if n not in pnames]
        what = []
        if only_p:
            what.append(f"only prefill has {only_p}")
        if only_d:
            what.append(f"only decode has {only_d}")
        if not what:
            what.append("the groups are in a different order")
        out.append(IncompatibleGeometry("decode.model.groups", f"group lists differ: {'; '.join(what)}",
                                        actual=dnames, expected=pnames,
                                        fix="configure both engines with the same KV-cache groups in the same order"))
        return tuple(out)
    for gi, (pg, dg) in enumerate(zip(pm.groups, dm.groups)):
        base = f"groups[{gi}]({pg.name})"
        if type(pg) is not type(dg):
            out.append(IncompatibleGeometry(f"decode.model.{base}.kind", f"{dg.kind.value} != prefill's {pg.kind.value}",
                                            actual=dg.kind.value, expected=pg.kind.value,
                                            fix="the same group must be attention or state on both sides"))
            continue
        if isinstance(pg, AttentionSpec) and isinstance(dg, AttentionSpec):
            differ(f"{base}.kind", pg.kind.value, dg.kind.value, "use the same attention kind on both sides")
            differ(f"{base}.num_layers", pg.num_layers, dg.num_layers, "both engines must serve every layer")
            differ(f"{base}.num_kv_heads", pg.num_kv_heads, dg.num_kv_heads, "total KV heads is a model fact")
            differ(f"{base}.head_bytes", pg.head_bytes, dg.head_bytes,
                   "use the same head size and cache dtype on both sides")
            differ(f"{base}.window_tokens", pg.window_tokens, dg.window_tokens, "use the same sliding window")
        elif isinstance(pg, StateSpec) and isinstance(dg, StateSpec):
            differ(f"{base}.num_layers", pg.num_layers, dg.num_layers, "both engines must serve every layer")
            differ(f"{base}.sections", pg.sections, dg.sections,
                   "describe the state sections identically (names, channels, unit bytes, rows, replication)")
    if not out:  # same groups and layer counts: pipeline stages partition one global layer order (§11.5)
        differ("global_layers", pm.layer_order(), dm.layer_order(),
               "describe the model's global layer order identically on both sides (ModelSpec.global_layers)")
    return tuple(out)


def _not_an_engine(side: str, value: Any) -> IncompatibleGeometry:
    return IncompatibleGeometry(f"Pair.{side}", f"expected EngineGeometry, got {type(value).__name__}",
                                actual=value_text(value, 60),
                                fix="build engines with EngineGeometry(...) or EngineGeometry.build(...)")


@attrs.frozen
class Compatibility:
    """The answer to "can these two engines be paired": ``ok`` and every reason when not."""

    ok: bool
    reasons: tuple[IncompatibleGeometry, ...]

    def __bool__(self) -> bool:
        return self.ok

    def __str__(self) -> str:
        if self.ok:
            return "pairable"
        return "not pairable:\n" + "\n".join(f"  - {r}" for r in self.reasons)


def pairable(prefill: EngineGeometry, decode: EngineGeometry) -> Compatibility:
    """Whether ``Pair(prefill, decode)`` would succeed, and why not, without raising (a side that is
    not an :class:`EngineGeometry` is a reason too)."""
    wrong = tuple(_not_an_engine(side, value) for side, value in (("prefill", prefill), ("decode", decode))
                  if not isinstance(value, EngineGeometry))
    if wrong:
        return Compatibility(False, wrong)
    reasons = incompatibilities(prefill, decode)
    return Compatibility(not reasons, reasons)


@attrs.frozen(repr=False)
class CheckedEngines:
    """Two engines that can exchange KV cache; raises :class:`IncompatibleGeometry` otherwise.

    The value every layer above shares: the simulator checks plans for an ``CheckedEngines``, and
    :class:`kvgeom.planning.Pair` (the same value, plus ``plan``) is what users build.
    """

    prefill: EngineGeometry
    decode: EngineGeometry

    def __attrs_post_init__(self) -> None:
        for side in ("prefill", "decode"):
            if not isinstance(getattr(self, side), EngineGeometry):
                raise _not_an_engine(side, getattr(self, side))
        reasons = incompatibilities(self.prefill, self.decode)
        logger.debug("pair check %s -> %s: %s", self.prefill.summary(), self.decode.summary(),
                     "pairable" if not reasons else f"{len(reasons)} incompatibilities, first: {reasons[0]}")
        if reasons:
            first = reasons[0]  # each further reason keeps its own expected and fix (err.more)
            raise IncompatibleGeometry(first.path, first.message, actual=first.actual, expected=first.expected,
                                       fix=first.fix, more=reasons[1:])

    @property
    def model(self) -> ModelSpec:
        return self.prefill.model

    def side(self, name: str) -> EngineGeometry:
        return self.prefill if name == "prefill" else self.decode

    def check_request(self, request: Request) -> None:
        """Raise :class:`RequestError` unless ``request`` fits both engines.

        Besides the structural rules (one listing of the right kind per group, block boundaries,
        ids inside the pools, distinct blocks in shared regions), every listing must cover what
        its side needs (:func:`~kvgeom.values.coverage.coverage_problems`) unless the request is
        ``partial`` on purpose.
        """
        check_instance("request", request, Request, error=RequestError,
                       fix="build the request with Request(...) or kvgeom.fresh_request(pair, tokens)")
        groups = self.model.groups
        if len(request.groups) != len(groups):
            raise RequestError("Request.groups", f"{len(request.groups)} group listings for a model with "
                               f"{len(groups)} groups", actual=len(request.groups), expected=len(groups),
                               fix="list every group, in the model's order")
        M, S = request.computed_tokens, request.prefix_hit_tokens
        bd = self.decode.logical_block_tokens
        if S % bd:
            raise RequestError("Request.prefix_hit_tokens", f"S={S} is not on a decode block boundary "
                               f"({bd} tokens per logical block)", actual=S, expected=f"a multiple of {bd}",
                               fix=f"round S down to {S // bd * bd}")
        for gi, (spec, gr) in enumerate(zip(groups, request.groups)):
            for side_name in ("prefill", "decode"):
                eng = self.side(side_name)
                listing = getattr(gr, side_name)
                path = f"Request.groups[{gi}]({spec.name}).{side_name}"
                nblocks = min(eng.num_logical_blocks(r) for r in eng.group_regions(gi))
                if isinstance(spec, AttentionSpec):
                    if not isinstance(listing, BlockList):
                        raise RequestError(path, f"attention group needs a BlockList, got {type(listing).__name__}",
                                           actual=type(listing).__name__, expected="BlockList")
                    B = eng.logical_block_tokens
                    if listing.first_token % B:
                        raise RequestError(f"{path}.first_token", f"{listing.first_token} is not on a {side_name} "
                                           f"block boundary ({B} tokens per logical block)",
                                           actual=listing.first_token, expected=f"a multiple of {B}",
                                           fix=f"start at token {listing.first_token // B * B}")
                    ids = listing.block_ids
                else:
                    if not isinstance(listing, StateSlots):
                        raise RequestError(path, f"state group needs StateSlots, got {type(listing).__name__}",
                                           actual=type(listing).__name__, expected="StateSlots")
                    ids = listing.slot_ids
                    if side_name == "prefill" and any(t > M for t in listing.tokens):
                        raise RequestError(f"{path}.tokens", f"a prefill state after {max(listing.tokens)} "
                                           f"tokens, but P computed only M={M}", actual=listing.tokens,
                                           expected=f"<= {M}", fix="list states P has computed")
                bad = [b for b in ids if b >= nblocks]
                if bad:
                    raise RequestError(f"{path}.block_ids", f"block id {bad[0]} is outside the {nblocks} logical "
                                       f"blocks of {side_name}'s regions", actual=bad[0],
                                       expected=f"0 <= id < {nblocks}", fix="use ids of this engine's block pool")

        for side_name in ("prefill", "decode"):
            self._check_shared_blocks(request, side_name)
        if request.partial:
            logger.debug("request check: partial on purpose, coverage not checked (M=%d, S=%d)", M, S)
            return
        problems = coverage_problems(self.model, self.prefill, self.decode, request)
        if problems:
            first = problems[0]  # each further problem keeps its own expected and fix (err.more)
            raise RequestError(first.path, first.message, actual=first.actual, expected=first.expected,
                               fix=first.fix, more=problems[1:])

    def writable_blocks(self, request: Request) -> dict[int, tuple[int, ...]]:
        """Per group, the D block ids (state groups: slot ids) a transfer of ``request`` may write.

        D's listed blocks minus the attention blocks wholly before S, which D already holds (its
        prefix-cache hit: never written, docs/design.md §4.2 (invariant 1)); the same pages the
        simulator calls writable (:func:`kvgeom.checking.writable_pages`). On a failed transfer these
        are the blocks to invalidate, and only these: the held prefix blocks stay valid.

        Worked number: D blocks of 16 tokens listed from token 0 as ids (4, 5, 6, 7) with S = 32:
        blocks 4 and 5 hold tokens [0, 32) and stay valid; ``{0: (6, 7)}``.
        """
        self.check_request(request)
        B, S = self.decode.logical_block_tokens, request.prefix_hit_tokens
        out: dict[int, tuple[int, ...]] = {}
        for gi, g in enumerate(request.groups):
            side = g.decode
            if isinstance(side, BlockList):
                held = max(0, min(len(side.block_ids), (S - side.first_token) // B))
                out[gi] = tuple(side.block_ids[held:])
            else:
                out[gi] = tuple(side.slot_ids)
        return out

    def _check_shared_blocks(self, request: Request, side_name: str) -> None:
        """Groups that share a region (the hybrid overlay) must list distinct blocks."""
        eng = self.side(side_name)
        users: dict[int, list[int]] = {}
        for gi in range(len(self.model.groups)):
            for region in eng.group_regions(gi):
                users.setdefault(region, []).append(gi)
        seen: set[tuple[int, ...]] = set()
        for region, gis in users.items():
            if len(gis) < 2 or tuple(gis) in seen:
                continue
            seen.add(tuple(gis))
            ids, owner = [], []
            for gi in gis:
                listing = getattr(request.groups[gi], side_name)
                got = listing.block_ids if isinstance(listing, BlockList) else listing.slot_ids
                ids.append(np.asarray(got, np.int64))
                owner.append(np.full(len(got), gi, np.int64))
            all_ids, all_owner = np.concatenate(ids), np.concatenate(owner)
            order = np.argsort(all_ids, kind="stable")
            a, o = all_ids[order], all_owner[order]
            clash = np.flatnonzero((a[1:] == a[:-1]) & (o[1:] != o[:-1]))
            if clash.size:
                i = int(clash[0])
                b, first, second = int(a[i]), int(o[i]), int(o[i + 1])
                raise RequestError(f"Request.groups[{second}]({self.model.groups[second].name}).{side_name}.block_ids",
                                   f"block {b} of region {region} is also listed by group {first} "
                                   f"({self.model.groups[first].name}); groups sharing a region must use distinct "
                                   "blocks", actual=b, expected="ids no other group of the region lists",
                                   fix="give every group its own blocks from the shared pool")

    def __repr__(self) -> str:
        return f"{type(self).__name__}(\n  {self.prefill.summary()}\n  {self.decode.summary()}\n)"

    def _repr_html_(self) -> str:
        return self.prefill._repr_html_() + self.decode._repr_html_()
