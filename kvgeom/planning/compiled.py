"""The compiled pair: every request-independent step of planning done once, so that planning a
request is integer arithmetic over its block ids (docs/design.md §13).

    Pair.compile() ---- once per pair -------------------------------------------------------------
      per attention group, per landing (direct; staged's arrived layout when staged applies):
        the pattern of one D kernel page of every alignment class (D page start mod lcm of the two
        page spans), from the reference planner's own row builder on a synthetic listing
        -> streams (d_rank, p_rank, d_region, p_region), families of streams, raw-row counts
      per state group: the pattern of one slot pair;  per attention group: the zero pattern of a page
      how the streams of all groups interleave in the plan's order
    CompiledPair.plan(request) ---- per request ---------------------------------------------------
      check the request (the reference rules, fast path first)
      units = the D pages [lo, hi) touches (ids from the block table), their kinds (class, or the
              partial window of the first and last page: computed once, cached), their P pages
      per family: representative rows over the units sorted by id, merged where ids are adjacent
      (or, for small plans and patterns without families, every stream at once)
      columns written in place, stream after stream (the order coalesce sorts into); notes, counts

The plan equals :func:`kvgeom.planning.plan_pair`'s, row for row, note for note (the reference path
stays the readable definition; ``tests/test_compiled.py`` compares the two over the hypothesis
strategies): both are the maximal runs of the same byte mapping in the same order.

Worked number: Llama-3-70B-like TP8 -> TP4 compiles to one family of 640 streams (4 D ranks x 2
P ranks x 80 layers) with a 2-piece page pattern; a 16k-token request is 1024 D pages, 2048
representative rows and 1,310,720 plan rows written by one broadcast per column.

This module is the public face: :class:`CompiledPair` checks the arguments, admits the plan against
the budget, weighs auto's choice against packed and writes the plan's columns. The compile step is
:mod:`kvgeom.planning.compile_step`, the per-request engine :mod:`kvgeom.planning.compiled_request`,
the row assembly :mod:`kvgeom.planning.assembly`.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import attrs
import numpy as np

from ..errors import KvGeomError, RequestError
from ..values.blocks import CopyBlock
from ..values.fields import check_instance, check_int
from ..values.model import AttentionSpec
from ..values.notes import Note, NoteKind
from ..values.pair import CheckedEngines
from ..values.plan import Copies, Rearrange, TransferPlan, Zeros, planner_columns
from ..values.request import Request, RequestShape
from .assembly import MERGE_ROWS as MERGE_ROWS
from .assembly import _materialize
from .budget import DEFAULT_BUDGET, PlanBudget, admit
from .choose import DEFAULT_COST_MODEL, CostModel, Strategy, check_strategy, weigh_packed
from .compile_step import _Source
from .compiled_request import FAMILY_LIMIT as FAMILY_LIMIT
from .compiled_request import FLAT_ROWS as FLAT_ROWS
from .compiled_request import _Group, _RequestEngine
from .packed import DEFAULT_STAGING_BYTES, packed_transfer_plan

__all__ = ["CompiledPair", "CompiledGroup", "compile_pair", "COMPILED_STRATEGIES"]

logger = logging.getLogger(__name__)

COMPILED_STRATEGIES: tuple[str, ...] = ("direct", "staged", "auto")  # packed: the reference path, noted


@attrs.frozen
class CompiledGroup:
    """What one group compiled to (:meth:`CompiledPair.stats`): its copy streams (one per
    (d_rank, p_rank, d_region, p_region)), the families they share a pattern in, the alignment
    classes of a D page (state groups: 1, the slot), the pieces one page (or slot pair) gives over
    every stream, its zero streams (d_rank, d_region), and whether staged has its own patterns."""

    kind: str
    streams: int
    families: int
    classes: int
    pieces_per_page: int
    zero_streams: int = 0
    staged: bool = False


class CompiledPair(_RequestEngine):
    """A pair with every request-independent step of planning done: :meth:`plan` returns the same
    :class:`~kvgeom.values.plan.TransferPlan` as :func:`kvgeom.planning.plan_reference`
    (docs/design.md §13)."""

    def stats(self) -> dict[str, CompiledGroup]:
        """Per group name, what it compiled to (:class:`CompiledGroup`)."""
        out: dict[str, CompiledGroup] = {}
        for gi, spec in enumerate(self.pair.model.groups):
            if gi in self.states:
                st = self.states[gi]
                out[spec.name] = CompiledGroup("state", len(st.table), len(st.families), 1, st.pieces_per_unit)
                continue
            d = self.direct[gi]
            out[spec.name] = CompiledGroup(spec.kind.value, len(d.table), len(d.families), d.classes,
                                           d.pieces_per_unit, len(self.zeros[gi].table),
                                           isinstance(self.staged[gi], _Source))
        return out

    def __repr__(self) -> str:
        parts = [f"{name}: {g.streams} streams in {g.families} famil{'y' if g.families == 1 else 'ies'}"
                 + (f", {g.classes} page classes" if g.classes > 1 else "") for name, g in self.stats().items()]
        return f"CompiledPair({self.pair.prefill.summary()} -> {self.pair.decode.summary()}; {'; '.join(parts)})"

    # ---- planning --------------------------------------------------------------------------------------
    def plan(self, request: Request, *, strategy: Strategy = "direct", cost_model: CostModel = DEFAULT_COST_MODEL,
             staging_bytes: int = DEFAULT_STAGING_BYTES, decode_rank: int | None = None,
             prefill_rank: int | None = None, budget: PlanBudget | None = DEFAULT_BUDGET) -> TransferPlan:
        """Plan ``request``: the same plan as :func:`kvgeom.planning.plan_reference`.

        ``decode_rank=d`` plans only what D rank ``d`` posts and applies (equal to
        ``plan.for_decode_rank(d)``); ``prefill_rank=p`` only what P rank ``p`` does (equal to
        ``plan.packed_for_prefill_rank(p)``: its copies, no zeros or rearranges, D applies those).
        Notes and the counts before coalescing are the whole plan's either way.

        Packed plans (``strategy="packed"``, or ``"auto"`` when packed is cheapest) come from the
        reference planner (:mod:`kvgeom.planning.packed`) with a ``REFERENCE_PATH`` note saying so;
        everything else in them equals the reference plan.

        Every argument is checked (typed errors), and before any row is built the whole plan's size
        is checked against ``budget`` (docs/design.md §14) as :func:`~kvgeom.planning.plan_pair`
        does; ``budget=None`` skips that (a caller that checked it already).
        """
        got, select, over = self._decide(request, strategy, cost_model, staging_bytes, decode_rank, prefill_rank,
                                         budget, "plan")
        if isinstance(got, TransferPlan):
            if select is None:
                return got
            return got.for_decode_rank(select[1]) if select[0] == 0 else got.packed_for_prefill_rank(select[1])
        groups, last = got
        copies = _materialize(self._blocks(groups, True, select), True)
        if prefill_rank is None:
            zeros = _materialize(self._blocks(groups, False, None if decode_rank is None else (0, decode_rank)), False)
        else:
            zeros = [np.zeros(0, np.int64) for _ in range(4)]
        rearranges = [r for g in groups for r in g.rearranges
                      if prefill_rank is None and (decode_rank is None or r.d_rank == decode_rank)]
        with planner_columns():
            plan = self._plan(strategy, groups, Copies(*copies), Zeros(*zeros), rearranges, last, over)
        if logger.isEnabledFor(logging.DEBUG):
            logger.debug("planned M=%d S=%d%s (%s, compiled%s): %d copies (%d before coalescing), %d B; %d zero rows, "
                         "%d B; %d rearranges", request.computed_tokens, request.prefix_hit_tokens,
                         " partial" if request.partial else "", strategy,
                         "" if select is None else f", {'D' if decode_rank is not None else 'P'} rank {select[1]}",
                         len(plan.copies), plan.copies_before_coalescing, plan.bytes_copied, len(plan.zeros),
                         plan.bytes_zeroed, len(plan.rearranges))
        return plan

    def copy_blocks(self, request: Request, *, strategy: Strategy = "direct",
                    cost_model: CostModel = DEFAULT_COST_MODEL, staging_bytes: int = DEFAULT_STAGING_BYTES,
                    decode_rank: int | None = None, prefill_rank: int | None = None,
                    budget: PlanBudget | None = DEFAULT_BUDGET) -> tuple[CopyBlock, ...]:
        """The copies :meth:`plan` would give (for one rank, with ``decode_rank`` or ``prefill_rank``)
        as outer-sum blocks in the plan's row order, never written out as columns: what
        :func:`kvgeom.lowering.tile_index_blocks` turns into prepared-table indices. A packed plan
        has no copies (its wire rows are its plan's)."""
        got, select, _ = self._decide(request, strategy, cost_model, staging_bytes, decode_rank, prefill_rank, budget,
                                      "blocks")
        if isinstance(got, TransferPlan):
            return ()
        return tuple(self._blocks(got[0], True, select))

    def _decide(self, request: Request, strategy: str, cost_model: CostModel, staging_bytes: int,
                decode_rank: int | None, prefill_rank: int | None, budget: PlanBudget | None, consumer: str
                ) -> tuple[TransferPlan | tuple[list[_Group], tuple[Note, ...]], tuple[int, int] | None,
                           tuple[Note, ...]]:
        """Every group's work for ``request`` (and auto's closing note), or a whole packed plan; and
        the budget's notes (auto leaving a candidate out) that follow the topology notes."""
        strategy = check_strategy(strategy)
        check_instance("cost_model", cost_model, CostModel, error=KvGeomError, fix="pass a kvgeom.CostModel(...)")
        staging_bytes = check_int("staging_bytes", staging_bytes, minimum=0, error=KvGeomError)
        check_instance("request", request, Request, error=RequestError, fix="pass a kvgeom.Request")
        if budget is not None:
            check_instance("budget", budget, PlanBudget, error=KvGeomError, fix="pass a kvgeom.PlanBudget(...) or None")
        pair = self.pair
        select = None
        if decode_rank is not None and prefill_rank is not None:
            raise KvGeomError("decode_rank", "plan for one rank: pass decode_rank or prefill_rank, not both",
                              actual=(decode_rank, prefill_rank), fix="drop one of them")
        if decode_rank is not None:
            pair.decode.coords(decode_rank)  # a GeometryError names a rank outside the engine
            select = (0, int(decode_rank))
        elif prefill_rank is not None:
            pair.prefill.coords(prefill_rank)
            select = (1, int(prefill_rank))
        memo = (strategy, cost_model, staging_bytes, budget)
        last = self._last
        if (last is not None and last[0] is request and last[1] == memo
                and last[3] != consumer):  # an executor's blocks, then its plan (or the other way round)
            self._last = None
            return last[2], select, last[4]
        self._id_arrays = {}
        if not self._valid(request):
            pair.check_request(request)
        over: tuple[Note, ...] = ()
        if budget is not None:  # checked before the request's rows (the check reads only its shape)
            strategy, staging_bytes, over = admit(pair, RequestShape.of(request), strategy, staging_bytes, budget)
        first = (Note(NoteKind.STRATEGY, f"strategy {'auto' if over else strategy}"),) + self.topology + over
        got: TransferPlan | tuple[list[_Group], tuple[Note, ...]]
        if strategy == "packed":
            got = self._reference_packed(request, staging_bytes, first)
        else:
            groups: list[_Group] = []
            for gi, spec in enumerate(pair.model.groups):
                if isinstance(spec, AttentionSpec):
                    groups.append(self._attention(request, gi, spec, strategy, cost_model))
                else:
                    groups.append(self._state(request, gi, cost_model if strategy == "auto" else None))
            got = (groups, ())
            if strategy == "auto":
                got = self._auto(request, groups, cost_model, staging_bytes, first)
        self._last = (request, memo, got, consumer, over)
        return got, select, over

    def _reference_packed(self, request: Request, staging_bytes: int, notes: tuple[Note, ...]) -> TransferPlan:
        plan = packed_transfer_plan(self.pair, request, staging_bytes, notes)
        note = Note(NoteKind.REFERENCE_PATH, "packed: planned on the reference path (kvgeom.planning.packed: pack and "
                    "unpack steps per rank pair and chunk, not rows); the compiled pair plans direct and staged rows")
        logger.debug("%s", note.text)
        with planner_columns():
            return attrs.evolve(plan, notes=plan.notes + (note,))

    def _auto(self, request: Request, groups: list[_Group], cost_model: CostModel, staging_bytes: int,
              first: tuple[Note, ...]) -> TransferPlan | tuple[list[_Group], tuple[Note, ...]]:
        """Auto's whole-plan step (the reference's ``_auto_plan``): the groups' choices against packed."""
        wins, why = weigh_packed(self.pair, request, staging_bytes, sum(g.cost for g in groups), cost_model)
        if wins:
            logger.debug("%s -> packed", why)
            return self._reference_packed(request, staging_bytes, first + (Note(NoteKind.AUTO_PACKED,
                                                                                why + " -> packed"),))
        kind = NoteKind.AUTO_STAGED if any(g.rearranges for g in groups) else NoteKind.AUTO_DIRECT
        logger.debug("%s -> not packed", why)
        return groups, (Note(kind, why + " -> not packed"),)

    def _plan(self, strategy: str, groups: Sequence[_Group], copies: Copies, zeros: Zeros,
              rearranges: Sequence[Rearrange], last: tuple[Note, ...], over: tuple[Note, ...] = ()) -> TransferPlan:
        pair = self.pair
        return TransferPlan(
            prefill_tp=pair.prefill.tp,
            decode_tp=pair.decode.tp,
            copies=copies,
            zeros=zeros,
            rearranges=rearranges,
            notes=(Note(NoteKind.STRATEGY, f"strategy {strategy}"),) + self.topology + over
            + tuple(n for g in groups for n in g.notes) + last,
            copies_before_coalescing=sum(g.raw_copies for g in groups),
            zeros_before_coalescing=sum(g.raw_zeros for g in groups),
            prefill_ranks=pair.prefill.num_ranks,
            decode_ranks=pair.decode.num_ranks,
        )


def compile_pair(pair: CheckedEngines) -> CompiledPair:
    """Compile ``pair`` (:class:`CompiledPair`)."""
    return CompiledPair(pair)
