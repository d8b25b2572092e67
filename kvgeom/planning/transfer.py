"""plan_transfer: two engine geometries and one request in, a :class:`TransferPlan` out.

Pure addressing arithmetic: no torch, no NIXL, no device, no I/O. Per group it chooses the
strategy (:mod:`kvgeom.planning.choose`), then coalesces every group's rows once; a packed plan
is planned whole (:mod:`kvgeom.planning.packed`)::

    request --> plan_group(g) for every group --> coalesce --> TransferPlan(copies, zeros,
                (attention: direct/staged;                       rearranges, notes)
                 state: direct)
            --> plan_packed (every group) -----------------> TransferPlan(packs, wire, unpacks,
                                                                           chunks, zeros, notes)
            auto: per group the cheaper of direct and staged, then that whole plan against packed

:class:`Pair` is the pair users build: the validated :class:`~kvgeom.values.pair.CheckedEngines`
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

from ..errors import IncompatibleGeometry, KvGeomError
from ..values.engine import EngineGeometry
from ..values.fields import check_instance, check_int
from ..values.notes import Note, NoteKind
from ..values.pair import CheckedEngines
from ..values.plan import Copies, TransferPlan, Zeros
from ..values.request import Request, RequestShape
from .budget import DEFAULT_BUDGET, PlanBudget, PlanEstimate, admit, estimate_compile, estimate_plan
from .choose import (
    DEFAULT_COST_MODEL,
    CostModel,
    Strategy,
    check_strategy,
    choose_group,
    plan_group,
    weigh_packed,
)
from .coalesce import coalesce, coalesce_zeros
from .compiled import COMPILED_STRATEGIES, CompiledPair
from .group import GroupPlan
from .packed import DEFAULT_STAGING_BYTES, packed_transfer_plan
from .topology import topology_notes

__all__ = ["Pair", "plan_transfer", "plan_pair", "plan_reference", "check_budget"]

logger = logging.getLogger(__name__)


class _Compiled:
    """A pair's compiled form, made on its second planned request (or by :meth:`Pair.compile`)."""

    def __init__(self) -> None:
        self.requests = 0
        self.compiled: CompiledPair | None = None
        self.lock = threading.Lock()

    def get(self, pair: CheckedEngines) -> CompiledPair:
        with self.lock:
            if self.compiled is None:
                self.compiled = CompiledPair(pair)
            return self.compiled


@attrs.frozen(repr=False)
class Pair(CheckedEngines):
    """Two engines that can exchange KV cache (raises :class:`~kvgeom.errors.IncompatibleGeometry`
    otherwise, naming the field), and the way to plan requests between them.

    A pair keeps its compiled form (docs/design.md §13): :meth:`compile` makes it now, and
    :meth:`plan` makes it on the pair's second request (one request is cheaper on the reference
    path than compiling); the plans are the same either way.
    """

    _compiled: _Compiled = attrs.field(init=False, factory=_Compiled, eq=False, repr=False)

    def plan(self, request: Request, *, strategy: Strategy = "direct",
             cost_model: CostModel = DEFAULT_COST_MODEL, staging_bytes: int = DEFAULT_STAGING_BYTES,
             budget: PlanBudget | None = DEFAULT_BUDGET) -> TransferPlan:
        """Plan ``request`` for this pair (:func:`plan_pair`)."""
        return plan_pair(self, request, strategy=strategy, cost_model=cost_model, staging_bytes=staging_bytes,
                         budget=budget)

    def estimate(self, request: Request, *, strategy: Strategy = "direct",
                 staging_bytes: int = DEFAULT_STAGING_BYTES) -> PlanEstimate:
        """Upper bounds of what planning ``request`` builds (:func:`~kvgeom.planning.budget.estimate_plan`)."""
        self.check_request(request)
        return estimate_plan(self, RequestShape.of(request), check_strategy(strategy),
                             staging_bytes=_staging(staging_bytes))

    def compile(self, *, budget: PlanBudget | None = DEFAULT_BUDGET) -> CompiledPair:
        """This pair with every request-independent step of planning done, once (cached): its
        :meth:`~kvgeom.planning.compiled.CompiledPair.plan` returns :func:`plan_reference`'s plans.

        Raises :class:`~kvgeom.errors.PlanBudgetExceeded` when compiling would exceed ``budget``
        (:func:`~kvgeom.planning.budget.estimate_compile`; pairs whose page spans have a huge least
        common multiple: plan such a pair with :func:`plan_pair`, which stays on the reference path)."""
        if budget is not None and self._compiled.compiled is None:
            check_instance("budget", budget, PlanBudget, error=KvGeomError, fix="pass a kvgeom.PlanBudget(...) or None")
            budget.check(estimate_compile(self), what="compile")
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
    staging_bytes: int = DEFAULT_STAGING_BYTES,
    budget: PlanBudget | None = DEFAULT_BUDGET,
) -> TransferPlan:
    """Plan ``request``'s transfer from ``prefill`` to ``decode``.

    The pair is checked once (and cached) before any request; raises
    :class:`~kvgeom.errors.IncompatibleGeometry` if the engines cannot be paired,
    :class:`~kvgeom.errors.RequestError` if the request does not fit them and
    :class:`~kvgeom.errors.PlanBudgetExceeded` if its plan would exceed ``budget``
    (docs/design.md §14; ``budget=None`` plans whatever the size). ``staging_bytes`` is the packed
    strategy's slot capacity per rank (docs/design.md §12.3); 0 means no staging, so ``auto``
    leaves packed out and ``packed`` raises :class:`~kvgeom.errors.StagingCapacityError` unless
    nothing moves.
    """
    for side, engine in (("prefill", prefill), ("decode", decode)):
        check_instance(f"plan_transfer.{side}", engine, EngineGeometry, error=IncompatibleGeometry,
                       fix="build engines with EngineGeometry(...) or EngineGeometry.build(...)")
    return plan_pair(_pair(prefill, decode), request, strategy=strategy, cost_model=cost_model,
                     staging_bytes=staging_bytes, budget=budget)


def _staging(staging_bytes: object) -> int:
    return check_int("staging_bytes", staging_bytes, minimum=0, error=KvGeomError)


def plan_pair(pair: CheckedEngines, request: Request, *, strategy: Strategy = "direct",
              cost_model: CostModel = DEFAULT_COST_MODEL, staging_bytes: int = DEFAULT_STAGING_BYTES,
              budget: PlanBudget | None = DEFAULT_BUDGET) -> TransferPlan:
    """:func:`plan_transfer` for an already built pair: the compiled path (docs/design.md §13) for a
    :class:`Pair` from its second request on (direct, staged, auto), else :func:`plan_reference`.
    Same plan either way.

    Before any row is built, the plan's size is estimated (:func:`estimate_plan`) and checked
    against ``budget`` (:class:`~kvgeom.errors.PlanBudgetExceeded` when over it); the pair is
    compiled only when compiling fits the budget too (:func:`~kvgeom.planning.budget.estimate_compile`),
    else it plans on the reference path.
    """
    strategy, staging_bytes = _arguments(pair, request, strategy, cost_model, staging_bytes, budget)
    chosen: str = strategy
    over: tuple[Note, ...] = ()
    if budget is not None:
        chosen, staging_bytes, over = admit(pair, RequestShape.of(request), strategy, staging_bytes, budget)
    if isinstance(pair, Pair) and chosen in COMPILED_STRATEGIES and not over:
        cache = pair._compiled
        cache.requests += 1
        if (cache.compiled is not None or cache.requests >= 2) and _compile_fits(pair, budget):
            return cache.get(pair).plan(request, strategy=chosen, cost_model=cost_model,  # type: ignore[arg-type]
                                        staging_bytes=staging_bytes, budget=None)  # admitted above
    return _reference(pair, request, chosen, cost_model, staging_bytes, over)


def plan_reference(pair: CheckedEngines, request: Request, *, strategy: Strategy = "direct",
                   cost_model: CostModel = DEFAULT_COST_MODEL, staging_bytes: int = DEFAULT_STAGING_BYTES,
                   budget: PlanBudget | None = DEFAULT_BUDGET) -> TransferPlan:
    """The reference planner: every group's rows built (:mod:`kvgeom.planning.attention`,
    :mod:`~kvgeom.planning.staged`, :mod:`~kvgeom.planning.state`), then coalesced; packed plans
    from :mod:`kvgeom.planning.packed`. The readable definition the compiled path is tested against
    (``tests/test_compiled.py``). Checks ``budget`` as :func:`plan_pair` does."""
    strategy, staging_bytes = _arguments(pair, request, strategy, cost_model, staging_bytes, budget)
    chosen: str = strategy
    over: tuple[Note, ...] = ()
    if budget is not None:
        chosen, staging_bytes, over = admit(pair, RequestShape.of(request), strategy, staging_bytes, budget)
    return _reference(pair, request, chosen, cost_model, staging_bytes, over)


def _arguments(pair: CheckedEngines, request: Request, strategy: object, cost_model: object, staging_bytes: object,
               budget: object) -> tuple[Strategy, int]:
    """Every argument checked (typed errors naming it) and the request checked against the pair."""
    checked = check_strategy(strategy)
    staging = _staging(staging_bytes)
    check_instance("cost_model", cost_model, CostModel, error=KvGeomError, fix="pass a kvgeom.CostModel(...)")
    if budget is not None:
        check_instance("budget", budget, PlanBudget, error=KvGeomError, fix="pass a kvgeom.PlanBudget(...) or None")
    check_instance("pair", pair, CheckedEngines, error=IncompatibleGeometry, fix="build the pair with kvgeom.Pair(P, D)")
    pair.check_request(request)
    return checked, staging  # type: ignore[return-value]


def _compile_fits(pair: CheckedEngines, budget: PlanBudget | None) -> bool:
    """Whether compiling ``pair`` fits ``budget`` (always without one); a pair whose compiling would
    not plans every request on the reference path (the same plans)."""
    return budget is None or budget.admits(estimate_compile(pair))


def _reference(pair: CheckedEngines, request: Request, strategy: str, cost_model: CostModel, staging_bytes: int,
               over: tuple[Note, ...] = ()) -> TransferPlan:
    first = (Note(NoteKind.STRATEGY, f"strategy {strategy if not over else 'auto'}"),) + topology_notes(pair) + over
    if strategy == "packed":
        plan = packed_transfer_plan(pair, request, staging_bytes, first)
    elif strategy == "auto":
        plan = _auto_plan(pair, request, cost_model, staging_bytes, first)
    else:
        groups = [plan_group(pair, request, gi, strategy) for gi in range(len(pair.model.groups))]
        plan = _assemble(pair, groups, first)
    if logger.isEnabledFor(logging.DEBUG):
        logger.debug("planned M=%d S=%d%s (%s): %d copies (%d before coalescing), %d B; %d zero rows, %d B; "
                     "%d rearranges; %d wire rows in %d chunks", request.computed_tokens, request.prefix_hit_tokens,
                     " partial" if request.partial else "", strategy, len(plan.copies),
                     plan.copies_before_coalescing, plan.bytes_copied, len(plan.zeros), plan.bytes_zeroed,
                     len(plan.rearranges), len(plan.wire), len(plan.chunks))
    return plan


def check_budget(pair: CheckedEngines, shape: RequestShape, strategy: str = "direct", *,
                 staging_bytes: int = DEFAULT_STAGING_BYTES, budget: PlanBudget = DEFAULT_BUDGET) -> None:
    """Raise :class:`~kvgeom.errors.PlanBudgetExceeded` when planning a request of ``shape`` would
    exceed ``budget`` (what :func:`plan_pair` checks first, ``auto``'s fallbacks included), without
    building the request."""
    check_instance("budget", budget, PlanBudget, error=KvGeomError, fix="pass a kvgeom.PlanBudget(...)")
    admit(pair, shape, check_strategy(strategy), _staging(staging_bytes), budget)


def _auto_plan(pair: CheckedEngines, request: Request, cost_model: CostModel, staging_bytes: int,
               first: tuple[Note, ...]) -> TransferPlan:
    """Per group the cheaper of direct and staged, then that plan against the packed plan, each
    counted by what it posts (docs/design.md §12.6)."""
    choices = [choose_group(pair, request, gi, cost_model) for gi in range(len(pair.model.groups))]
    wins, why = weigh_packed(pair, request, staging_bytes, sum(c.cost for c in choices), cost_model)
    if wins:
        logger.debug("%s -> packed", why)
        return packed_transfer_plan(pair, request, staging_bytes, first + (Note(NoteKind.AUTO_PACKED, why + " -> packed"),))
    groups = [c.plan.with_notes(c.note) if c.note is not None else c.plan for c in choices]
    kind = NoteKind.AUTO_STAGED if any(g.rearranges for g in groups) else NoteKind.AUTO_DIRECT
    logger.debug("%s -> not packed", why)
    return _assemble(pair, groups, first, (Note(kind, why + " -> not packed"),))


def _assemble(pair: CheckedEngines, groups: list[GroupPlan], first: tuple[Note, ...],
              last: tuple[Note, ...] = ()) -> TransferPlan:
    copies = [g.copies for g in groups]
    zeros = [g.zeros for g in groups if len(g.zeros)] or [Zeros.empty()]
    raw_c = copies[0] if len(copies) == 1 else Copies.concat(copies)
    raw_z = zeros[0] if len(zeros) == 1 else Zeros.concat(zeros)
    return TransferPlan(
        prefill_tp=pair.prefill.tp,
        decode_tp=pair.decode.tp,
        copies=coalesce(raw_c),
        zeros=coalesce_zeros(raw_z),
        rearranges=[r for g in groups for r in g.rearranges],
        notes=first + tuple(n for g in groups for n in g.notes) + last,
        copies_before_coalescing=sum(g.rows_before_coalescing for g in groups),
        zeros_before_coalescing=len(raw_z),
        prefill_ranks=pair.prefill.num_ranks,
        decode_ranks=pair.decode.num_ranks,
    )
