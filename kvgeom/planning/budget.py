"""The work budget: how large a request's plan will be, estimated before any row is built.

A geometry can come from a remote peer and a request from a connector on every step, so the
planner bounds its work before doing it (docs/design.md §14). :func:`estimate_plan` mirrors the
planners in O(groups x ranks) arithmetic on the geometry and the request's *shape* (token ranges
and block counts, never the ids); :meth:`PlanBudget.check` refuses an estimate over the budget
with :class:`~kvgeom.errors.PlanBudgetExceeded`::

    request --RequestShape.of--> (M, S, per group: first token + block count per side)
        --estimate_plan(pair, shape, strategy)--> PlanEstimate(copy_rows, zero_rows, segments,
                                                   rearrange_pages, steps, work, bytes)
        --PlanBudget.check--> ok | PlanBudgetExceeded (estimate, budget, how to raise it)

Per attention group and (D rank, source P rank, plane set), from the segments and the modes of a
segment (token, head[, plane]) folded as ``kvgeom.arith.runs.fold_modes`` does:

    segments = 1 + |cuts(P) U cuts(D)| in (lo, hi)     cuts every K tokens: two progressions, their
                                                       union counted with the Chinese remainder theorem
    rows     = sum over segment lengths L of count(L) x rows(L)     exact: the cut pattern repeats every
                                                       lcm of the steps, so the counts come from one period
             <= segments x R  or  (hi - lo) x R'       where a side's pages are token-outermost (it cuts
                                                       only where block ids jump): a bound for any length
    x layers; the planner's whole-page collapse only makes the real count smaller

State groups are counted exactly (paired slots x layers x the unfolded channel/row modes); staged
adds its rearranges (D ranks x layers x planes, each listing the touched D pages); auto counts
both strategies and builds one. ``tests/test_budget.py`` checks estimate >= the real plan on drawn
pairs, and that the estimate is not loose where no page collapses.

Worked number: P and D TP1, HND, K = 16, 80 layers of 8 heads x 256 B, M = 16,384 tokens: both
sides cut every 16 tokens at the same points, so 1,024 segments of 16 tokens; for 16 tokens the
token, head and plane modes all fold (256 B runs make 4096 B = the head stride, 8 heads make
32768 B = the plane stride), one row per segment and layer: 1,024 x 80 = 81,920 copy rows
estimated. The planner builds 80, since each layer's consecutive pages collapse into one run.

This module holds the budget and the admission (:class:`PlanBudget`, :func:`admit`,
:func:`estimate_plan`, :func:`quick_estimate`, :func:`estimate_compile`); the estimate value and
the shared counting are :mod:`kvgeom.planning.estimate`, the per-strategy estimates
:mod:`kvgeom.planning.estimate_rows` (direct, staged, zeros, state) and
:mod:`kvgeom.planning.estimate_packed` (packed).
"""

from __future__ import annotations

import math

import attrs

from ..arith.ints import ceil_div
from ..errors import IncompatibleGeometry, InternalError, KvGeomError, PlanBudgetExceeded, RequestError
from ..values.fields import check_instance, check_int
from ..values.model import AttentionSpec, StateSpec
from ..values.notes import Note, NoteKind
from ..values.pair import CheckedEngines
from ..values.request import MAX_LISTED, ListingShape, RequestShape
from .choose import check_strategy
from .estimate import (
    _COMPILING,
    PAGE_ENTRY_BYTES,
    ROW_BYTES,
    SEGMENT_BYTES,
    STAGING_ENTRY_BYTES,
    STAGING_STEP_BYTES,
    STEP_WORK,
    PlanEstimate,
    _factors,
)
from .estimate import BASE_BYTES as BASE_BYTES
from .estimate import BIG as BIG
from .estimate import MAX_PERIOD_POINTS as MAX_PERIOD_POINTS
from .estimate_packed import LIGHT_WORK, _packed, _packed_factors, _packed_state, _quick_packed
from .estimate_packed import MAX_COUNTED as MAX_COUNTED
from .estimate_packed import REFINE_LIMIT as REFINE_LIMIT
from .estimate_packed import REFINE_STEPS as REFINE_STEPS
from .estimate_packed import TOKEN_MAP_STEPS as TOKEN_MAP_STEPS
from .estimate_rows import (
    _attention,
    _attention_factors_of,
    _per_token,
    _quick_copies,
    _quick_tokens,
    _quick_zeros,
    _state,
)
from .packed import DEFAULT_STAGING_BYTES
from .sides import SideView

__all__ = ["PlanBudget", "PlanEstimate", "DEFAULT_BUDGET", "estimate_plan", "estimate_compile", "quick_estimate", "admit",
           "ROW_BYTES",
           "SEGMENT_BYTES", "PAGE_ENTRY_BYTES", "STAGING_ENTRY_BYTES", "STAGING_STEP_BYTES", "STEP_WORK"]


@attrs.frozen
class PlanBudget:
    """What planning one request may cost; the planner refuses an estimate beyond it.

    ``max_bytes``: peak planner memory (default 4 GiB, so a plan and its simulation fit a 24 GB
    machine with room for the engines' own caches); ``max_work``: row and segment operations
    (default 2**28: at the 2 to 30 million per second measured on this project's 2-core machine,
    seconds to two minutes of planning); ``max_steps``: Python-level
    iterations (default 2**16, each tens of microseconds; a remote claiming ``tp = 2**20`` is refused
    here, in O(groups), before anything loops over its ranks).
    """

    max_bytes: int = attrs.field(default=4 << 30)
    max_work: int = attrs.field(default=1 << 28)
    max_steps: int = attrs.field(default=1 << 16)

    def __attrs_post_init__(self) -> None:
        for name in ("max_bytes", "max_work", "max_steps"):
            check_int(f"PlanBudget.{name}", getattr(self, name), minimum=1, error=KvGeomError)

    def admits(self, estimate: PlanEstimate) -> bool:
        """Whether ``estimate`` is within all three limits."""
        return (estimate.bytes <= self.max_bytes and estimate.work <= self.max_work
                and estimate.steps <= self.max_steps)

    def check(self, estimate: PlanEstimate, *, what: str = "plan") -> None:
        """Raise :class:`PlanBudgetExceeded` when ``estimate`` exceeds any of the three limits."""
        for name, have, limit, unit in (("max_bytes", estimate.bytes, self.max_bytes, "bytes of planner memory"),
                                        ("max_work", estimate.work, self.max_work, "row operations"),
                                        ("max_steps", estimate.steps, self.max_steps, "planner steps")):
            if have > limit:
                raise PlanBudgetExceeded(
                    what, f"the {what} would need about {have:,} {unit} (estimate: {estimate}), beyond the budget "
                          f"of {limit:,}", actual=estimate, expected=f"{name} <= {limit:,}",
                    fix=f"plan fewer tokens or layers, or raise the budget: budget=PlanBudget({name}="
                        f"{_raise(have)}) (the command line: {_flag(name, _raise(have))}; Endpoint(..., budget=...) "
                        "or a link call's budget=)")


CLI_FLAGS = {"max_bytes": "--budget-mb", "max_work": "--max-work", "max_steps": "--max-steps"}
"""The ``kvgeom plan | transfer | fuzz`` flag that raises each limit of :class:`PlanBudget`."""


def _flag(name: str, value: int) -> str:
    """The command-line flag and value that raise limit ``name`` to ``value`` (``--budget-mb`` counts MiB)."""
    return f"{CLI_FLAGS[name]} {-(-value // 2**20) if name == 'max_bytes' else value}"


def _raise(n: int) -> int:
    """A round number above ``n`` (a budget that would admit it)."""
    return 1 << max(1, n.bit_length())


DEFAULT_BUDGET = PlanBudget()
ESTIMATE_LIMIT = PlanBudget(max_steps=1 << 22)  # without a budget the estimate still refuses absurd rank counts


def _quick(pair: CheckedEngines, shape: RequestShape, strategy: str, staging: int) -> PlanEstimate:
    """A looser bound of :func:`estimate_plan` in O(groups) from cached per-pair numbers (rows per
    token, zero rows per zeroed token, pairs): what the budget admits first, so that a small
    request (a decode step, one token) costs microseconds of checking; only a request it does not
    admit gets the exact estimate."""
    total = PlanEstimate()
    packed = PlanEstimate()
    if strategy == "packed" or (strategy == "auto" and staging):
        all_pairs = sum(_packed_factors(pair, gi, isinstance(spec, AttentionSpec)).pairs
                        for gi, spec in enumerate(pair.model.groups))
        packed = PlanEstimate(steps=1 + all_pairs // 16, work=STEP_WORK + all_pairs * LIGHT_WORK)
    for gi, spec in enumerate(pair.model.groups):
        if isinstance(spec, StateSpec):
            total = total + _state(pair, shape, gi)
            if packed.steps:
                packed = packed + _packed_state(pair, shape, gi, staging, 0)
            continue
        T, Z = _quick_tokens(pair, shape, gi)
        f = _attention_factors_of(pair, gi, False)
        _, per_zero = _factors(pair, ("per-token", gi, False), lambda f=f: _per_token(f))  # type: ignore[misc]
        zeros = _quick_zeros(f, per_zero, Z)
        if strategy in ("direct", "staged"):
            total = total + _quick_copies(pair, gi, strategy == "staged", T) + zeros
        elif strategy == "auto":
            total = total + _quick_copies(pair, gi, False, T) + _quick_copies(pair, gi, True, T) + zeros
        if packed.steps:
            packed = packed + _quick_packed(pair, gi, T, staging) + zeros
    if strategy == "packed":
        return packed
    total = total + PlanEstimate(work=total.copy_rows + total.zero_rows)  # coalescing
    if packed.steps:
        total = total + packed + PlanEstimate(steps=packed.chunks, work=packed.work // 4)
    return total


def _coarse_steps(pair: CheckedEngines) -> int:
    """A lower bound of the Python-level iterations planning makes (per D rank, per P stage and per
    source), in O(groups): refused before :func:`estimate_plan` loops over the ranks or stages of a
    remote claiming absurd sizes."""
    P, D = pair.prefill, pair.decode
    total = 0
    for spec in pair.model.groups:
        n_axes = 1 if isinstance(spec, AttentionSpec) else len(spec.sections)
        total += n_axes * D.num_ranks * (1 + min(P.tp, D.tp)) + D.topology.pp * P.topology.pp
    return total


COMPILE_CLASS_STEPS = 8  # a compiled page class: its rows built, keyed, cut into pieces (per landing)


def estimate_compile(pair: CheckedEngines) -> PlanEstimate:
    """Upper bounds of what :meth:`Pair.compile` builds (docs/design.md §13): per attention group and
    landing, the rows of every alignment class of a D page, from a synthetic listing of
    ``2 x lcm(page spans) + 2 x D span`` tokens, so at most a plan of that many tokens (windows
    ignored) plus a few steps per class; a state group's one slot pair. Cached per pair; a
    compile beyond the budget leaves the pair on the reference path (the same plans)."""
    check_instance("pair", pair, CheckedEngines, error=IncompatibleGeometry, fix="build the pair with kvgeom.Pair(P, D)")
    return _factors(pair, ("compile",), lambda: _estimate_compile(pair))


def _estimate_compile(pair: CheckedEngines) -> PlanEstimate:
    P, D = pair.prefill, pair.decode
    coarse = _coarse_steps(pair)
    if coarse > ESTIMATE_LIMIT.max_steps:  # never loop over the ranks of an absurd pair: no budget admits it
        return PlanEstimate(steps=coarse, work=coarse * STEP_WORK)
    reach = 1
    classes = owners = 0
    for gi, spec in enumerate(pair.model.groups):
        if isinstance(spec, AttentionSpec):
            span_d, span_p = D.kernel_block_tokens * D.topology.dcp, P.kernel_block_tokens * P.topology.dcp
            period = math.lcm(span_d, span_p)
            reach = max(reach, 2 * period + 2 * span_d)
            classes += 2 * (period // span_d)  # direct and staged landings
            if SideView(P, gi).linear() or SideView(D, gi).linear():  # the first token of every owner pair
                owners += math.lcm(*(e.topology.interleave * e.topology.dcp for e in (P, D)))
    blocks = max(ceil_div(reach, e.logical_block_tokens) + 2 for e in (P, D))
    if blocks > MAX_LISTED:  # its synthetic listing could not even be built
        return PlanEstimate(steps=1 << 62, work=1 << 62)
    groups = []
    for spec in pair.model.groups:
        if isinstance(spec, AttentionSpec):
            groups.append((ListingShape(0, ceil_div(reach, P.logical_block_tokens) + 2),
                           ListingShape(0, ceil_div(reach, D.logical_block_tokens) + 2)))
        else:
            groups.append((ListingShape(0, 1), ListingShape(0, 1)))
    shape = RequestShape(reach, 0, tuple(groups), tuple(1 for _ in groups))
    token = _COMPILING.set(True)
    try:
        total = estimate_plan(pair, shape, "auto", staging_bytes=0)
    finally:
        _COMPILING.reset(token)
    steps = classes * COMPILE_CLASS_STEPS + owners // 64
    return total + PlanEstimate(segments=owners, steps=steps, work=steps * STEP_WORK + 20 * owners)


def quick_estimate(pair: CheckedEngines, shape: RequestShape, strategy: str = "direct", *,
                   budget: PlanBudget | None = None, staging_bytes: int = DEFAULT_STAGING_BYTES) -> PlanEstimate:
    """A looser upper bound than :func:`estimate_plan`, in O(groups) once the pair's factors are
    cached: rows per moved token times the tokens (packed: pieces, classes and entries from the
    tokens). The planner admits a request with it first and computes the exact estimate only when
    it is over the budget."""
    _check_shape(pair, shape, budget)
    strategy = check_strategy(strategy)
    staging = check_int("staging_bytes", staging_bytes, minimum=0, error=KvGeomError)
    return _quick(pair, shape, strategy, staging)


def _check_shape(pair: CheckedEngines, shape: RequestShape, budget: PlanBudget | None) -> None:
    """The arguments are what they claim, the shape lists the model's groups, and the ranks alone
    are within the budget's steps."""
    check_instance("pair", pair, CheckedEngines, error=IncompatibleGeometry, fix="build the pair with kvgeom.Pair(P, D)")
    check_instance("shape", shape, RequestShape, error=RequestError,
                   fix="use RequestShape.of(request) or kvgeom.building.fresh_shape")
    if budget is not None:
        check_instance("budget", budget, PlanBudget, error=KvGeomError, fix="pass a kvgeom.PlanBudget(...) or None")
    if len(shape.groups) != len(pair.model.groups):
        raise RequestError("request.groups", f"the request lists {len(shape.groups)} groups, the model has "
                           f"{len(pair.model.groups)}", actual=len(shape.groups), expected=len(pair.model.groups),
                           fix="list every group of the model, in its order")
    coarse = _coarse_steps(pair)
    limit = budget if budget is not None else ESTIMATE_LIMIT
    if coarse > limit.max_steps:
        limit.check(PlanEstimate(steps=coarse, work=coarse * STEP_WORK), what="plan")


def estimate_plan(pair: CheckedEngines, shape: RequestShape, strategy: str = "direct", *,
                  budget: PlanBudget | None = None, staging_bytes: int = DEFAULT_STAGING_BYTES) -> PlanEstimate:
    """Upper bounds of the rows, segments, rearranged pages and steps of planning ``shape`` on ``pair``
    (a packed plan, or auto's packed candidate, with ``staging_bytes`` per rank: its chunks, wire
    rows and pack/unpack steps too).

    Refuses first, in O(groups), when the ranks alone exceed ``budget``'s steps (without a budget,
    2**24 of them), so the estimate itself never loops over a hostile TP.
    """
    staging_bytes = check_int("staging_bytes", staging_bytes, minimum=0, error=KvGeomError)
    _check_shape(pair, shape, budget)
    strategy = check_strategy(strategy)
    if strategy == "packed":
        total = _packed(pair, shape, staging_bytes)
        return total + PlanEstimate(work=total.zero_rows)
    total = PlanEstimate()
    for gi, spec in enumerate(pair.model.groups):
        if isinstance(spec, StateSpec):
            total = total + _state(pair, shape, gi)
        elif strategy == "direct":
            total = total + _attention(pair, shape, gi, staged=False)
        elif strategy == "staged":
            total = total + _attention(pair, shape, gi, staged=True)
        else:  # auto counts both (without rows), then builds one
            direct = _attention(pair, shape, gi, staged=False)
            staged = _attention(pair, shape, gi, staged=True)
            total = total + direct.peak(staged) + PlanEstimate(segments=direct.segments + staged.segments)
    # coalescing sorts and merges every copy and zero row once more
    total = total + PlanEstimate(work=total.copy_rows + total.zero_rows)  # coalescing
    if strategy == "auto" and staging_bytes > 0:
        # auto also counts the packed plan (count_packed) and may build it while holding the others
        packed = _packed(pair, shape, staging_bytes)
        total = total + packed + PlanEstimate(steps=packed.chunks, work=packed.work // 4)
    return total


def admit(pair: CheckedEngines, shape: RequestShape, strategy: str, staging_bytes: int,
          budget: PlanBudget) -> tuple[str, int, tuple[Note, ...]]:
    """Check the plan's estimate against ``budget`` (:class:`~kvgeom.errors.PlanBudgetExceeded` when
    over it) and return the strategy and staging bytes to plan with, and the notes that say why
    they changed (none when they did not). ``auto`` weighs only the candidates within the budget:
    without packed when packed alone is too large, only packed when direct and staged are (an
    ``AUTO_OVER_BUDGET`` note says which)."""
    if budget.admits(quick_estimate(pair, shape, strategy, budget=budget, staging_bytes=staging_bytes)):
        return strategy, staging_bytes, ()  # a looser bound admits it already (a small request)
    estimate = estimate_plan(pair, shape, strategy, budget=budget, staging_bytes=staging_bytes)
    if strategy != "auto" or not staging_bytes or budget.admits(estimate):
        budget.check(estimate)
        return strategy, staging_bytes, ()
    without = estimate_plan(pair, shape, "auto", budget=budget, staging_bytes=0)
    if budget.admits(without):
        return "auto", 0, (Note(NoteKind.AUTO_OVER_BUDGET, f"auto: packed left out, its plan with {staging_bytes} B "
                                f"per rank would exceed the budget (auto with it: {estimate})"),)
    packed = estimate_plan(pair, shape, "packed", budget=budget, staging_bytes=staging_bytes)
    if budget.admits(packed):
        return "packed", staging_bytes, (Note(NoteKind.AUTO_OVER_BUDGET, f"auto: direct and staged left out, their "
                                              f"plans would exceed the budget ({without}); packed"),)
    budget.check(estimate)
    raise InternalError("an estimate over the budget was admitted")
