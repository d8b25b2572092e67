"""plan_transfer: two engine geometries and one request in, a :class:`TransferPlan` out.

Pure addressing arithmetic: no torch, no NIXL, no device, no I/O. Per group it chooses the
strategy (:mod:`kvgeom.planning.choose`), then coalesces every group's rows once::

    request --> plan_group(g) for every group --> coalesce --> TransferPlan(copies, zeros,
                (attention: direct/staged/auto;                  rearranges, notes)
                 state: direct)

:class:`Pair` is the pair users build: the validated :class:`~kvgeom.values.pair.EnginePair`
plus :meth:`Pair.plan`.

Worked number: P and D both TP1, HND, K=16, one layer of 8 heads x 256 B (64 KiB pages), 64
tokens on fresh blocks 0..3 on both sides: every page is one whole-page run and the 4 pages are
consecutive on both sides, so they collapse into 1 row of 4 * 65536 = 262144 B before coalescing
(``copies_before_coalescing == 1``); with P ids 0, 2, 1, 3 the plan keeps 4 rows
(docs/design.md §4.3).
"""

from __future__ import annotations

import functools
import logging
import threading

import attrs

from ..errors import KvGeomError
from ..values.engine import EngineGeometry
from ..values.notes import Note, NoteKind
from ..values.pair import EnginePair
from ..values.plan import Copies, TransferPlan, Zeros
from ..values.request import Request
from .choose import DEFAULT_COST_MODEL, STRATEGIES, CostModel, Strategy, plan_group
from .coalesce import coalesce, coalesce_zeros
from .compiled import CompiledPair
from .topology import topology_notes

__all__ = ["Pair", "plan_transfer", "plan_pair", "plan_reference"]

logger = logging.getLogger(__name__)


class _Compiled:
    """A pair's compiled form, made on its second planned request (or by :meth:`Pair.compile`)."""

    def __init__(self) -> None:
        self.requests = 0
        self.compiled: CompiledPair | None = None
        self.lock = threading.Lock()

    def get(self, pair: EnginePair) -> CompiledPair:
        with self.lock:
            if self.compiled is None:
                self.compiled = CompiledPair(pair)
            return self.compiled


@attrs.frozen(repr=False)
class Pair(EnginePair):
    """Two engines that can exchange KV cache (raises :class:`~kvgeom.errors.IncompatibleGeometry`
    otherwise, naming the field), and the way to plan requests between them.

    A pair keeps its compiled form (docs/design.md §12): :meth:`compile` makes it now, and
    :meth:`plan` makes it on the pair's second request (one request is cheaper on the reference
    path than compiling); the plans are the same either way.
    """

    _compiled: _Compiled = attrs.field(init=False, factory=_Compiled, eq=False, repr=False)

    def plan(self, request: Request, *, strategy: Strategy = "direct",
             cost_model: CostModel = DEFAULT_COST_MODEL) -> TransferPlan:
        """Plan ``request`` for this pair (:func:`plan_pair`)."""
        return plan_pair(self, request, strategy=strategy, cost_model=cost_model)

    def compile(self) -> CompiledPair:
        """This pair with every request-independent step of planning done, once (cached): its
        :meth:`~kvgeom.planning.compiled.CompiledPair.plan` returns :func:`plan_reference`'s plans."""
        return self._compiled.get(self)


@functools.lru_cache(maxsize=64)
def _pair(prefill: EngineGeometry, decode: EngineGeometry) -> Pair:
    return Pair(prefill, decode)


def plan_transfer(
    prefill: EngineGeometry,
    decode: EngineGeometry,
    request: Request,
    *,
    strategy: Strategy = "direct",
    cost_model: CostModel = DEFAULT_COST_MODEL,
) -> TransferPlan:
    """Plan ``request``'s transfer from ``prefill`` to ``decode``.

    The pair is checked once (and cached) before any request; raises
    :class:`~kvgeom.errors.IncompatibleGeometry` if the engines cannot be paired and
    :class:`~kvgeom.errors.RequestError` if the request does not fit them.
    """
    return plan_pair(_pair(prefill, decode), request, strategy=strategy, cost_model=cost_model)


def plan_pair(pair: EnginePair, request: Request, *, strategy: Strategy = "direct",
              cost_model: CostModel = DEFAULT_COST_MODEL) -> TransferPlan:
    """:func:`plan_transfer` for an already built pair: the compiled path (docs/design.md §12) for a
    :class:`Pair` from its second request on, else :func:`plan_reference`. Same plan either way."""
    if isinstance(pair, Pair):
        cache = pair._compiled
        cache.requests += 1
        if cache.compiled is not None or cache.requests >= 2:
            return cache.get(pair).plan(request, strategy=strategy, cost_model=cost_model)
    return plan_reference(pair, request, strategy=strategy, cost_model=cost_model)


def plan_reference(pair: EnginePair, request: Request, *, strategy: Strategy = "direct",
                   cost_model: CostModel = DEFAULT_COST_MODEL) -> TransferPlan:
    """The reference planner: every group's rows built (:mod:`kvgeom.planning.attention`,
    :mod:`~kvgeom.planning.staged`, :mod:`~kvgeom.planning.state`), then coalesced. The readable
    definition the compiled path is tested against (``tests/test_compiled.py``)."""
    if strategy not in STRATEGIES:
        raise KvGeomError("strategy", f"unknown strategy {strategy!r}", actual=strategy,
                          expected=list(STRATEGIES), fix=f"use one of {', '.join(STRATEGIES)}")
    pair.check_request(request)
    groups = [plan_group(pair, request, gi, strategy, cost_model) for gi in range(len(pair.model.groups))]
    copies = [g.copies for g in groups]
    zeros = [g.zeros for g in groups if len(g.zeros)] or [Zeros.empty()]
    raw_c = copies[0] if len(copies) == 1 else Copies.concat(copies)
    raw_z = zeros[0] if len(zeros) == 1 else Zeros.concat(zeros)
    topology = topology_notes(pair)
    plan = TransferPlan(
        prefill_tp=pair.prefill.tp,
        decode_tp=pair.decode.tp,
        copies=coalesce(raw_c),
        zeros=coalesce_zeros(raw_z),
        rearranges=[r for g in groups for r in g.rearranges],
        notes=(Note(NoteKind.STRATEGY, f"strategy {strategy}"),) + topology + tuple(n for g in groups for n in g.notes),
        copies_before_coalescing=sum(g.rows_before_coalescing for g in groups),
        zeros_before_coalescing=len(raw_z),
        prefill_ranks=pair.prefill.num_ranks,
        decode_ranks=pair.decode.num_ranks,
    )
    if logger.isEnabledFor(logging.DEBUG):
        logger.debug("planned M=%d S=%d%s (%s): %d copies (%d before coalescing), %d B; %d zero rows, %d B; "
                     "%d rearranges", request.computed_tokens, request.prefix_hit_tokens,
                     " partial" if request.partial else "", strategy, len(plan.copies),
                     plan.copies_before_coalescing, plan.bytes_copied, len(plan.zeros), plan.bytes_zeroed,
                     len(plan.rearranges))
    return plan
