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

from ..errors import KvGeomError, StagingCapacityError
from ..values.engine import EngineGeometry
from ..values.notes import Note, NoteKind
from ..values.pair import EnginePair
from ..values.plan import Copies, TransferPlan, Zeros
from ..values.request import Request
from .choose import DEFAULT_COST_MODEL, STRATEGIES, CostModel, Strategy, choose_group, plan_group
from .coalesce import coalesce, coalesce_zeros
from .compiled import COMPILED_STRATEGIES, CompiledPair
from .group import GroupPlan
from .packed import DEFAULT_STAGING_BYTES, PackedCount, count_packed, packed_transfer_plan
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

    A pair keeps its compiled form (docs/design.md §13): :meth:`compile` makes it now, and
    :meth:`plan` makes it on the pair's second request (one request is cheaper on the reference
    path than compiling); the plans are the same either way.
    """

    _compiled: _Compiled = attrs.field(init=False, factory=_Compiled, eq=False, repr=False)

    def plan(self, request: Request, *, strategy: Strategy = "direct",
             cost_model: CostModel = DEFAULT_COST_MODEL, staging_bytes: int = DEFAULT_STAGING_BYTES) -> TransferPlan:
        """Plan ``request`` for this pair (:func:`plan_pair`)."""
        return plan_pair(self, request, strategy=strategy, cost_model=cost_model, staging_bytes=staging_bytes)

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
    staging_bytes: int = DEFAULT_STAGING_BYTES,
) -> TransferPlan:
    """Plan ``request``'s transfer from ``prefill`` to ``decode``.

    The pair is checked once (and cached) before any request; raises
    :class:`~kvgeom.errors.IncompatibleGeometry` if the engines cannot be paired and
    :class:`~kvgeom.errors.RequestError` if the request does not fit them. ``staging_bytes`` is
    the packed strategy's slot capacity per rank (docs/design.md §12.3); 0 means no staging, so
    ``auto`` leaves packed out and ``packed`` raises :class:`~kvgeom.errors.StagingCapacityError`
    unless nothing moves.
    """
    return plan_pair(_pair(prefill, decode), request, strategy=strategy, cost_model=cost_model,
                     staging_bytes=staging_bytes)


def plan_pair(pair: EnginePair, request: Request, *, strategy: Strategy = "direct",
              cost_model: CostModel = DEFAULT_COST_MODEL, staging_bytes: int = DEFAULT_STAGING_BYTES) -> TransferPlan:
    """:func:`plan_transfer` for an already built pair: the compiled path (docs/design.md §13) for a
    :class:`Pair` from its second request on (direct, staged, auto), else :func:`plan_reference`.
    Same plan either way."""
    if isinstance(pair, Pair) and strategy in COMPILED_STRATEGIES:
        cache = pair._compiled
        cache.requests += 1
        if cache.compiled is not None or cache.requests >= 2:
            return cache.get(pair).plan(request, strategy=strategy, cost_model=cost_model,
                                        staging_bytes=staging_bytes)
    return plan_reference(pair, request, strategy=strategy, cost_model=cost_model, staging_bytes=staging_bytes)


def plan_reference(pair: EnginePair, request: Request, *, strategy: Strategy = "direct",
                   cost_model: CostModel = DEFAULT_COST_MODEL, staging_bytes: int = DEFAULT_STAGING_BYTES) -> TransferPlan:
    """The reference planner: every group's rows built (:mod:`kvgeom.planning.attention`,
    :mod:`~kvgeom.planning.staged`, :mod:`~kvgeom.planning.state`), then coalesced; packed plans
    from :mod:`kvgeom.planning.packed`. The readable definition the compiled path is tested against
    (``tests/test_compiled.py``)."""
    if strategy not in STRATEGIES:
        raise KvGeomError("strategy", f"unknown strategy {strategy!r}", actual=strategy,
                          expected=list(STRATEGIES), fix=f"use one of {', '.join(STRATEGIES)}")
    pair.check_request(request)
    first = (Note(NoteKind.STRATEGY, f"strategy {strategy}"),) + topology_notes(pair)
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


def _auto_plan(pair: EnginePair, request: Request, cost_model: CostModel, staging_bytes: int,
               first: tuple[Note, ...]) -> TransferPlan:
    """Per group the cheaper of direct and staged, then that plan against the packed plan, each
    counted by what it posts (docs/design.md §12.6)."""
    choices = [choose_group(pair, request, gi, cost_model) for gi in range(len(pair.model.groups))]
    unpacked = sum(c.cost for c in choices)
    try:
        count = count_packed(pair, request, staging_bytes)
    except StagingCapacityError:  # packed cannot be planned with this capacity: not a candidate
        count = PackedCount(0, 0, 0, 0)
    packed = cost_model.packed_cost(count.wire_rows, count.bytes, count.operations)
    why = (f"auto: direct/staged {unpacked * 1e6:.1f} us (posted copies of every group); packed "
           f"{count.wire_rows} wire rows in {count.chunks} chunks + 2 x {count.bytes} B copied + "
           f"{count.operations} operations = {packed * 1e6:.1f} us ({cost_model.describe()}); "
           f"{count.bytes} B on the wire either way ({cost_model.wire_seconds(count.bytes) * 1e6:.1f} us)")
    if count.wire_rows and packed < unpacked:
        logger.debug("%s -> packed", why)
        return packed_transfer_plan(pair, request, staging_bytes, first + (Note(NoteKind.AUTO_PACKED, why + " -> packed"),))
    groups = [c.plan.with_notes(c.note) if c.note is not None else c.plan for c in choices]
    kind = NoteKind.AUTO_STAGED if any(g.rearranges for g in groups) else NoteKind.AUTO_DIRECT
    logger.debug("%s -> not packed", why)
    return _assemble(pair, groups, first, (Note(kind, why + " -> not packed"),))


def _assemble(pair: EnginePair, groups: list[GroupPlan], first: tuple[Note, ...],
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
