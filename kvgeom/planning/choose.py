"""Per group, which strategy builds its rows (direct, staged), and what ``auto`` weighs: the cost
of each strategy counted by what it posts (docs/design.md §5, §12.6).

    attention group --strategy--> direct  (kvgeom.planning.attention)
                               -> staged  (kvgeom.planning.staged; falls back to direct, noted)
    state group     ----------->  direct  (kvgeom.planning.state; states are always copied in place)
    whole plan      --packed--->  every group through staging (kvgeom.planning.packed)
                    --auto----->  per attention group the cheaper of direct and staged, then the
                                  whole plan against packed (kvgeom.planning.transfer)

    direct  = posted copies x descriptor_seconds
    staged  = posted copies x descriptor_seconds + rearranged bytes / rearrange_bytes_per_second
    packed  = wire rows x descriptor_seconds + 2 x bytes / copy_bytes_per_second + operations x op_seconds
    (+ bytes / wire_bytes_per_second for all three: the same bytes cross the wire)

Posted copies are rows after coalescing (NIXL pays per descriptor it is handed). :func:`posted`
counts them: the count before coalescing (no rows built) is an upper bound; when it is at most
``CostModel.exact_rows`` the rows are built and coalesced for the exact count.

Worked number: 4096 direct copies cost ``4096 * 1.5 us = 6144 us``; staged with 512 copies and
64 MiB rearranged costs ``512 * 1.5 us + 67108864 B / 1.5 GB/s = 768 us + 44739 us``; packed with
4 wire rows, the same 64 MiB and 16 operations costs ``6 us + 2 * 67108864 / 8e9 s + 16 * 20 us
= 17.1 ms``: auto picks direct.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import Literal

import attrs

from ..errors import KvGeomError, StagingCapacityError, value_text
from ..values.model import AttentionSpec
from ..values.notes import Note, NoteKind
from ..values.pair import CheckedEngines
from ..values.request import Request
from .attention import plan_attention_group
from .coalesce import coalesce
from .group import GroupPlan
from .packed import PackedCount, count_packed
from .staged import plan_staged_group
from .state import plan_state_group

__all__ = ["Strategy", "STRATEGIES", "CostModel", "DEFAULT_COST_MODEL", "plan_group", "Posted", "posted", "weigh_packed", "check_strategy",
           "GroupChoice", "choose_group"]

logger = logging.getLogger(__name__)

Strategy = Literal["direct", "staged", "auto", "packed"]
STRATEGIES: tuple[str, ...] = ("direct", "staged", "auto", "packed")


def check_strategy(strategy: object) -> str:
    """``strategy`` if it names one of :data:`STRATEGIES`; else a :class:`~kvgeom.errors.KvGeomError`
    naming it (never a huge value in the message)."""
    if not isinstance(strategy, str) or strategy not in STRATEGIES:
        raise KvGeomError("strategy", f"unknown strategy {value_text(strategy, 60)}", actual=value_text(strategy, 60),
                          expected=list(STRATEGIES), fix=f"use one of {', '.join(STRATEGIES)}")
    return strategy


@attrs.frozen
class CostModel:
    """What ``strategy="auto"`` weighs (docs/design.md §12.6); the defaults are :meth:`cpu`,
    measured on the project's 2-core CPU machine (``python -m benchmarks.costs`` and ``python -m
    benchmarks --only transfer,packed``; the VM is noisy, so each default sits inside the spread):

    * ``descriptor_seconds`` 1.5 us: NIXL's cost per posted descriptor, in-process over UCX
      (measured 1.26-2.1 us; real NICs pay 3-5 us per RDMA request).
    * ``rearrange_bytes_per_second`` 1.5 GB/s: the staged strategy's in-place torch rearrange
      (measured 0.6-3.2 GB/s).
    * ``copy_bytes_per_second`` 8 GB/s: one pack or unpack pass (torch, one thread; measured
      5.8 GB/s for 256-byte head vectors changing layout, 16 GB/s for 4 KiB runs).
    * ``op_seconds`` 20 us: one pack or unpack operation, planning its views included (measured 23 us).
    * ``wire_bytes_per_second`` 15 GB/s: the bytes NIXL moves once posted (7 GB/s from 4 KiB-page
      memory, 15-18 GB/s between huge-page staging rings); the same for every strategy, it only
      makes the totals in the notes honest.
    * ``exact_rows``: candidates with at most this many rows before coalescing are built and
      coalesced to count their posted descriptors exactly.
    * ``packed_setup_seconds`` 0: a packed transfer's fixed cost beyond its rows and operations,
      for a caller whose packed transfers pay one (the vLLM connector: D's offer to P, P planning
      the same plan, the staging protocol's round trips, about 12 ms here, docs/design.md §15.3).
    """

    descriptor_seconds: float = 1.5e-6
    rearrange_bytes_per_second: float = 1.5e9
    copy_bytes_per_second: float = 8e9
    op_seconds: float = 20e-6
    wire_bytes_per_second: float = 1.5e10
    exact_rows: int = 1 << 18
    packed_setup_seconds: float = 0.0

    @classmethod
    def cpu(cls) -> CostModel:
        """CPU DRAM, measured on the project's 2-core machine (``python -m benchmarks.costs``)."""
        return cls()

    @classmethod
    def cuda(cls) -> CostModel:
        """An H100/H200-class GPU with an RDMA NIC: *estimates*, not measured here (no GPU in this
        project's CI); ``scripts/gpu-check`` measures the copy and descriptor numbers to replace them."""
        return cls(descriptor_seconds=4e-6, rearrange_bytes_per_second=1e12, copy_bytes_per_second=1e12,
                   op_seconds=10e-6, wire_bytes_per_second=4.5e10)

    def cost(self, copies: int, rearranged_bytes: int) -> float:
        """Direct or staged: posted copies and rearranged bytes (the wire bytes are left out)."""
        return copies * self.descriptor_seconds + rearranged_bytes / self.rearrange_bytes_per_second

    def packed_cost(self, wire_rows: int, nbytes: int, operations: int) -> float:
        """Packed: wire rows, two copy passes over ``nbytes``, the pack and unpack operations, and
        the fixed ``packed_setup_seconds``."""
        return (wire_rows * self.descriptor_seconds + 2 * nbytes / self.copy_bytes_per_second
                + operations * self.op_seconds + self.packed_setup_seconds)

    def wire_seconds(self, nbytes: int) -> float:
        return nbytes / self.wire_bytes_per_second

    def describe(self) -> str:
        return (f"{self.descriptor_seconds * 1e6:g} us/descriptor, copy {self.copy_bytes_per_second:.3g} B/s, "
                f"rearrange {self.rearrange_bytes_per_second:.3g} B/s, {self.op_seconds * 1e6:g} us/op"
                + (f", packed setup {self.packed_setup_seconds * 1e3:g} ms" if self.packed_setup_seconds else ""))


DEFAULT_COST_MODEL = CostModel()


@attrs.frozen(eq=False)
class Posted:
    """A candidate group plan and the descriptors it posts: ``exact`` when counted after
    coalescing, else the count before coalescing (an upper bound); ``plan`` holds the built
    group plan when the count was exact."""

    count: int
    exact: bool
    rearranged: int = 0
    plan: GroupPlan | None = None


def posted(pair: CheckedEngines, request: Request, gi: int, strategy: str, cost_model: CostModel) -> Posted:
    """Descriptors group ``gi`` posts under ``strategy`` ("direct" or "staged"), counted without
    building rows first, then exactly when there are at most ``cost_model.exact_rows``."""
    planner = plan_attention_group if strategy == "direct" else plan_staged_group
    counted = planner(pair, request, gi, materialize=False)
    moved = sum(r.nbytes_per_page * len(r.pages) for r in counted.rearranges)
    if counted.rows_before_coalescing > cost_model.exact_rows:
        return Posted(counted.rows_before_coalescing, False, moved)
    built = planner(pair, request, gi)
    return Posted(len(coalesce(built.copies)), True, moved, built)


@attrs.frozen(eq=False)
class GroupChoice:
    """Auto's choice for one group between direct and staged: its cost (seconds, wire bytes left
    out), the note saying why (``None`` when staged does not apply), and the plan, built when first
    read (``build``): auto weighs the whole plan against packed first, so a group whose count was
    an estimate (more than ``exact_rows`` rows) is never built when packed wins."""

    cost: float
    note: Note | None
    build: Callable[[], GroupPlan] = attrs.field(repr=False)
    _built: list[GroupPlan] = attrs.field(factory=list, init=False, repr=False)

    @property
    def plan(self) -> GroupPlan:
        """The chosen group plan (built on the first read)."""
        if not self._built:
            self._built.append(self.build())
        return self._built[0]


def _ready(plan: GroupPlan | None, build: Callable[[], GroupPlan]) -> Callable[[], GroupPlan]:
    return build if plan is None else (lambda: plan)


def choose_group(pair: CheckedEngines, request: Request, gi: int, cost_model: CostModel) -> GroupChoice:
    """Group ``gi`` under auto (direct or staged; state groups are direct): the cheaper plan by
    posted descriptors, built once (when first read, if counting did not build it)."""
    if not isinstance(pair.model.groups[gi], AttentionSpec):
        built = plan_state_group(pair, request, gi)
        return GroupChoice(cost_model.cost(len(coalesce(built.copies)), 0), None, lambda: built)
    staged_count = plan_staged_group(pair, request, gi, materialize=False)
    direct = posted(pair, request, gi, "direct", cost_model)
    cost_d = cost_model.cost(direct.count, 0)
    build_direct = _ready(direct.plan, functools.partial(plan_attention_group, pair, request, gi))
    if not staged_count.rearranges:  # staged does not apply or equals direct
        logger.debug("%s: auto: staged does not apply or changes nothing -> direct", pair.model.groups[gi].name)
        return GroupChoice(cost_d, None, build_direct)
    staged = posted(pair, request, gi, "staged", cost_model)
    cost_s = cost_model.cost(staged.count, staged.rearranged)
    name = pair.model.groups[gi].name

    def counted(p: Posted) -> str:
        return f"{p.count} copies posted" + ("" if p.exact else " (estimate: count before coalescing)")

    why = (f"{name}: auto: direct {counted(direct)} = {cost_d * 1e6:.1f} us; staged {counted(staged)} + "
           f"{staged.rearranged} B rearranged = {cost_s * 1e6:.1f} us ({cost_model.describe()})")
    if cost_s < cost_d:
        logger.debug("%s -> staged", why)
        return GroupChoice(cost_s, Note(NoteKind.AUTO_STAGED, why + " -> staged"),
                           _ready(staged.plan, functools.partial(plan_staged_group, pair, request, gi)))
    logger.debug("%s -> direct", why)
    return GroupChoice(cost_d, Note(NoteKind.AUTO_DIRECT, why + " -> direct"), build_direct)


def plan_group(pair: CheckedEngines, request: Request, gi: int, strategy: str,
               cost_model: CostModel = DEFAULT_COST_MODEL) -> GroupPlan:
    """Group ``gi`` of ``request`` under ``strategy`` ("direct", "staged", or "auto": the cheaper of
    the two for this group; state groups are always direct). Packed plans are whole-plan
    (:func:`kvgeom.planning.packed.plan_packed`)."""
    if not isinstance(pair.model.groups[gi], AttentionSpec):
        return plan_state_group(pair, request, gi)
    if strategy == "staged":
        out = plan_staged_group(pair, request, gi)
        for n in out.notes:
            if n.kind is NoteKind.STAGED_NOT_APPLICABLE:
                logger.warning("staged asked for, direct planned instead: %s", n.text)
        return out
    if strategy == "auto":
        choice = choose_group(pair, request, gi, cost_model)
        return choice.plan.with_notes(choice.note) if choice.note is not None else choice.plan
    return plan_attention_group(pair, request, gi)


def weigh_packed(pair: CheckedEngines, request: Request, staging_bytes: int, unpacked: float,
                 cost_model: CostModel) -> tuple[bool, str]:
    """Auto's whole-plan step (docs/design.md §12.6): whether the packed plan, counted without being
    built (:func:`~kvgeom.planning.packed.count_packed`), costs less than ``unpacked`` (the chosen
    direct/staged plans' posted copies), and the sentence that says why. A capacity packed cannot
    plan with is no candidate."""
    if staging_bytes == 0:  # no staging: count_packed could only refuse (or count a request moving nothing: 0s)
        count = PackedCount(0, 0, 0, 0)
    else:
        try:
            count = count_packed(pair, request, staging_bytes)
        except StagingCapacityError:
            count = PackedCount(0, 0, 0, 0)
    packed = cost_model.packed_cost(count.wire_rows, count.bytes, count.operations)
    why = (f"auto: direct/staged {unpacked * 1e6:.1f} us (posted copies of every group); packed "
           f"{count.wire_rows} wire rows in {count.chunks} chunks + 2 x {count.bytes} B copied + "
           f"{count.operations} operations = {packed * 1e6:.1f} us ({cost_model.describe()}); "
           f"{count.bytes} B on the wire either way ({cost_model.wire_seconds(count.bytes) * 1e6:.1f} us)")
    return bool(count.wire_rows) and packed < unpacked, why
