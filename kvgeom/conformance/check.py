"""Check a connector's own transfer with the reference simulator, and report in the connector's terms.

    connector rows (ids kept) --> TransferPlan --> simulate (docs/design.md §7) --> Report
         each listed violation --> the rows whose bytes it touches (descriptor ids),
                                   the logical block, tokens and layer of its bytes (locate_byte)
         --> ConformanceReport: ok, counts, ConnectorViolation("not_zeroed: decode rank 0 region 1
             bytes [960, 1152): mla layer 1 block 3 tokens 32..47; no row writes these bytes")

The connector states what D tokens at or past M (P never computed them) in its last listed D
blocks may hold, ``beyond_computed``: ``"zero"`` (kvgeom's contract, the default) or ``"any"`` (an
engine whose attention masks by sequence length, such as vLLM, which copies P's whole last page).
Whatever a connector leaves there is reported as its own kind, BEYOND_COMPUTED, never WRONG_DATA:
counted under ``"zero"`` (stale bytes there stay NOT_ZEROED), put under ``ignored`` under ``"any"``.

The connector is held to kvgeom's invariants (docs/design.md §4.2) except minimality (invariant 5):
a connector may post one descriptor per block and leave merging to NIXL, so ``NOT_MINIMAL``
findings are counted under ``ignored`` unless ``require_minimal=True``. Rows with ranks outside
the engines and descriptors outside every registered region are reported as ``OUT_OF_BOUNDS``
without being simulated.

Worked number (the README's vLLM case): D blocks of 24 tokens in 8-token kernel pages of 12-byte
latents (96 B), P blocks of 8 tokens in 4-token pages (48 B), M = 28. The pre-fix connector paired
8 P pages (tokens [0, 32)) and zeroed nothing, so D block 3's kernel pages 10 and 11 (tokens 32..47)
keep stale bytes: ``2 * 96 = 192`` B per region, one NOT_ZEROED violation per region.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import attrs
import numpy as np

from ..checking.content import check_beyond_computed
from ..checking.describe import ByteCoordinate, locate_byte
from ..checking.report import Report, Violation, ViolationKind
from ..checking.simulator import simulate
from ..errors import IncompatibleGeometry, PlanError, value_text
from ..values.engine import EngineGeometry
from ..values.fields import check_instance
from ..values.layout import AttentionGroupGeometry
from ..values.pair import CheckedEngines
from ..values.plan import TransferPlan
from ..values.planes import PlanesLayout
from ..values.request import Request
from .rows import MAX_CONNECTOR_ROWS, ConnectorRows, Unresolved, check_max_rows, over_budget

__all__ = ["ConnectorViolation", "ConformanceReport", "check_connector"]

logger = logging.getLogger(__name__)

_MAX_ROWS_NAMED = 8  # connector rows named per violation


@attrs.frozen
class ConnectorViolation:
    """One finding in the connector's terms: what, where (side, rank, region, bytes), which of the
    connector's rows touch those bytes, and the logical block, tokens and layer they hold."""

    kind: ViolationKind
    side: str
    rank: int
    region: int
    offset: int
    nbytes: int
    rows: tuple[str, ...] = ()  # the connector's labels of the rows that touch these bytes
    group: str | None = None
    layer: int | None = None
    block: int | None = None  # logical block (attention) or state slot id on that side
    tokens: tuple[int, int] | None = None  # first and last token of the bytes, when the block is listed
    coordinate: str = ""
    detail: str = ""

    def __str__(self) -> str:
        where = f"{self.side} rank {self.rank} region {self.region} bytes [{self.offset}, {self.offset + self.nbytes})"
        what = []
        if self.group is not None:
            what.append(f"{self.group} layer {self.layer}")
        if self.block is not None:
            what.append(f"block {self.block}")
        if self.tokens is not None:
            a, b = self.tokens
            what.append(f"token {a}" if a == b else f"tokens {a}..{b}")
        rows = "; rows " + ", ".join(self.rows) if self.rows else "; no row writes these bytes" \
            if self.side == "decode" else ""
        detail = f" ({self.detail})" if self.detail else ""
        return f"{self.kind.value}: {where}: {' '.join(what) or self.coordinate}{rows}{detail}"


@attrs.frozen
class ConformanceReport:
    """The verdict on a connector's transfer: ``ok`` unless a counted kind occurred.

    ``counts`` / ``bytes_bad`` are exact per kind (``ignored``: kinds not held against the
    connector, e.g. NOT_MINIMAL); ``violations`` lists at most 20 per kind (the simulator's limit);
    ``report`` is the simulator's own :class:`~kvgeom.checking.report.Report`;
    ``beyond_computed`` the policy the tail past M was held to.
    """

    violations: tuple[ConnectorViolation, ...]
    counts: dict[ViolationKind, int]
    bytes_bad: dict[ViolationKind, int]
    ignored: dict[ViolationKind, int]
    report: Report
    beyond_computed: str = "zero"

    @property
    def ok(self) -> bool:
        return not any(self.counts.values())

    def of_kind(self, kind: ViolationKind) -> tuple[ConnectorViolation, ...]:
        return tuple(v for v in self.violations if v.kind is kind)

    def __str__(self) -> str:
        if self.ok:
            extra = "; ignored: " + ", ".join(f"{k.value} x{n}" for k, n in self.ignored.items()) if self.ignored else ""
            policy = "; tokens past M may hold anything (beyond_computed='any')" \
                if self.beyond_computed == "any" else ""
            return f"conforms: {self.report.bytes_checked} D bytes checked{extra}{policy}"
        parts = [f"{k.value} x{n} ({self.bytes_bad.get(k, 0)} B differ)" for k, n in self.counts.items() if n]
        return "\n".join([f"does not conform: {', '.join(parts)}"] + [f"  {v}" for v in self.violations])


def _touching(side: str, v: Violation, rows: ConnectorRows) -> tuple[str, ...]:
    """Labels of the connector rows whose bytes on ``v``'s side overlap ``v``'s byte range."""
    c, z = rows.copies, rows.zeros
    lo, hi = v.offset, v.offset + v.nbytes
    if side == "prefill":
        hit = np.flatnonzero((c.p_rank == v.rank) & (c.p_region == v.region) & (c.p_offset < hi)
                             & (c.p_offset + c.nbytes > lo))
        return tuple(rows.label(int(i)) for i in hit[:_MAX_ROWS_NAMED])
    hit = np.flatnonzero((c.d_rank == v.rank) & (c.d_region == v.region) & (c.d_offset < hi)
                         & (c.d_offset + c.nbytes > lo))
    zhit = np.flatnonzero((z.d_rank == v.rank) & (z.d_region == v.region) & (z.d_offset < hi)
                          & (z.d_offset + z.nbytes > lo))
    out = [rows.label(int(i)) for i in hit[:_MAX_ROWS_NAMED]]
    out += [rows.label(int(i), zero=True) for i in zhit[:max(0, _MAX_ROWS_NAMED - len(out))]]
    return tuple(out)


def _planes_slots(engine: EngineGeometry, first: ByteCoordinate, region: int, lo: int,
                  hi: int) -> tuple[int, int] | None:
    """The lowest and highest slot whose bytes of ``first``'s layer lie in bytes ``[lo, hi)`` of
    ``region`` (inside ``first``'s page), for a per-plane layout (docs/design.md §3.5), whose first and last bytes need not
    hold the first and last tokens (a transposed K); ``None`` for a plain layout."""
    g = first.group_index
    geo = engine.groups[g]
    if not isinstance(geo, AttentionGroupGeometry) or not isinstance(geo.layout, PlanesLayout):
        return None
    view = geo.views[first.layer]
    slots = np.arange(engine.kernel_block_tokens)
    found: list[np.ndarray] = []
    for plane, preg in enumerate(view.regions):
        if preg != region:
            continue
        heads = np.arange(engine.local_heads(g))[:, None, None]
        _, starts = engine.attention_address(g, first.layer, plane, first.page, slots[None, :, None], heads)
        where = starts + engine.attention_vector_bytes(g, plane)[None, None, :]  # (head, slot, byte)
        inside = (where >= lo) & (where < hi)
        if inside.any():
            found.append(np.flatnonzero(inside.any(axis=(0, 2))))
    if not found:
        return None
    hit = np.concatenate(found)
    return int(hit.min()), int(hit.max())


def _translate(pair: CheckedEngines, request: Request, rows: ConnectorRows, v: Violation) -> ConnectorViolation:
    engine: EngineGeometry = pair.side(v.side)
    first = locate_byte(engine, request, v.side, v.rank, v.region, v.offset)
    last = locate_byte(engine, request, v.side, v.rank, v.region, v.offset + max(0, v.nbytes - 1))
    tokens: tuple[int, int] | None = None
    if first is not None and first.kind == "attention" and first.token is not None:
        end = last.token if last is not None and last.token is not None and last.group == first.group \
            and last.layer == first.layer else None
        tokens = (first.token, first.token if end is None else end)
        if end is not None and last is not None and last.page == first.page:
            page_end = (first.page + 1) * engine.regions[v.region].page_bytes
            span = _planes_slots(engine, first, v.region, v.offset, min(v.offset + v.nbytes, page_end))
            if span is not None:  # tokens of one page: the first token of the page plus the slot
                base = first.token - first.slot
                tokens = (base + span[0], base + span[1])
    return ConnectorViolation(
        v.kind, v.side, v.rank, v.region, v.offset, v.nbytes, _touching(v.side, v, rows),
        group=None if first is None else first.group, layer=None if first is None else first.layer,
        block=None if first is None else first.block, tokens=tokens, coordinate=v.coordinate, detail=v.detail)


def check_connector(pair: CheckedEngines, request: Request, rows: ConnectorRows, *,
                    unresolved: Sequence[Unresolved] = (), require_minimal: bool = False,
                    beyond_computed: str = "zero",
                    max_rows: int | None = MAX_CONNECTOR_ROWS) -> ConformanceReport:
    """Run the connector's rows through the reference simulator and report in its terms.

    ``rows``: :meth:`ConnectorRows.from_rows`, :meth:`ConnectorRows.from_plan` or
    :func:`~kvgeom.conformance.rows.rows_from_descriptors` (whose unresolved descriptors go in
    ``unresolved``). ``beyond_computed``: ``"zero"`` or ``"any"``, what D tokens at or past M in
    listed D blocks may hold (see the module). Raises :class:`~kvgeom.errors.RequestError` when the request does not fit the
    pair (the request itself, not the connector, is wrong then), :class:`~kvgeom.errors.PlanError`
    for arguments of the wrong kind, and :class:`~kvgeom.errors.PlanBudgetExceeded` before
    simulating more than ``max_rows`` copy plus zero rows (plus unresolved descriptors;
    ``max_rows=None`` checks any size; the simulator still refuses engines beyond 4 GiB).
    """
    check_instance("pair", pair, CheckedEngines, error=IncompatibleGeometry, fix="build the pair with kvgeom.Pair(P, D)")
    check_instance("rows", rows, ConnectorRows, error=PlanError,
                   fix="build the rows with ConnectorRows.from_rows(...) or rows_from_descriptors(...)")
    if not isinstance(require_minimal, bool):
        raise PlanError("require_minimal", f"must be a bool, got {value_text(require_minimal, 60)}",
                        actual=value_text(require_minimal, 60), expected="True or False")
    limit = check_max_rows(max_rows)
    policy = check_beyond_computed(beyond_computed)
    if isinstance(unresolved, (str, bytes)) or not isinstance(unresolved, Sequence):
        raise PlanError("unresolved", f"expected a sequence of Unresolved, got {type(unresolved).__name__}",
                        actual=value_text(unresolved, 60), expected="a tuple of Unresolved",
                        fix="pass the second value rows_from_descriptors returns")
    over_budget("rows", len(rows.copies) + len(rows.zeros) + len(unresolved), limit,
                "copy, zero and unresolved rows")
    for i, u in enumerate(unresolved):
        check_instance(f"unresolved[{i}]", u, Unresolved, error=PlanError,
                       fix="pass the second value rows_from_descriptors returns")
    c, z = rows.copies, rows.zeros
    P, D = pair.prefill, pair.decode
    keep = (c.p_rank < P.num_ranks) & (c.d_rank < D.num_ranks)
    zkeep = z.d_rank < D.num_ranks
    plain = (P.num_ranks, D.num_ranks) == (P.tp, D.tp)
    limits = f"tp {P.tp} / {D.tp}" if plain else f"{P.num_ranks} / {D.num_ranks} ranks"
    extra: list[ConnectorViolation] = []
    for i in np.flatnonzero(~keep)[:_MAX_ROWS_NAMED].tolist():
        extra.append(ConnectorViolation(ViolationKind.OUT_OF_BOUNDS, "decode", int(c.d_rank[i]), int(c.d_region[i]),
                                        int(c.d_offset[i]), int(c.nbytes[i]), (rows.label(i),),
                                        detail=f"P rank {int(c.p_rank[i])} / D rank {int(c.d_rank[i])} outside "
                                               f"{limits}"))
    for i in np.flatnonzero(~zkeep)[:_MAX_ROWS_NAMED].tolist():
        extra.append(ConnectorViolation(ViolationKind.OUT_OF_BOUNDS, "decode", int(z.d_rank[i]), int(z.d_region[i]),
                                        int(z.d_offset[i]), int(z.nbytes[i]), (rows.label(i, zero=True),),
                                        detail=f"D rank {int(z.d_rank[i])} outside "
                                               + (f"tp {D.tp}" if plain else f"{D.num_ranks} ranks")))
    for u in unresolved:
        extra.append(ConnectorViolation(ViolationKind.OUT_OF_BOUNDS, u.side, u.rank, -1, u.address, u.nbytes,
                                        (u.label,), detail="these bytes lie in no registered region of the rank"))
    outside = int((~keep).sum() + (~zkeep).sum()) + len(unresolved)
    kept = attrs.evolve(rows, copies=c.take(keep), zeros=z.take(zkeep), copy_ids=rows.copy_ids[keep],
                        zero_ids=rows.zero_ids[zkeep])
    plan = TransferPlan(P.tp, D.tp, kept.copies, kept.zeros, kept.rearranges, prefill_ranks=P.num_ranks,
                        decode_ranks=D.num_ranks)
    report = simulate(pair, request, plan, beyond_computed=policy)
    ignored_kinds = set() if require_minimal else {ViolationKind.NOT_MINIMAL}
    if policy == "any":
        ignored_kinds.add(ViolationKind.BEYOND_COMPUTED)
    counts = {k: n for k, n in report.counts.items() if k not in ignored_kinds}
    bytes_bad = {k: n for k, n in report.bytes_bad.items() if k not in ignored_kinds}
    if outside:
        counts[ViolationKind.OUT_OF_BOUNDS] = counts.get(ViolationKind.OUT_OF_BOUNDS, 0) + outside
        bytes_bad[ViolationKind.OUT_OF_BOUNDS] = bytes_bad.get(ViolationKind.OUT_OF_BOUNDS, 0) + sum(
            v.nbytes for v in extra)
    violations = tuple(extra) + tuple(_translate(pair, request, kept, v) for v in report.violations
                                      if v.kind not in ignored_kinds)
    ignored = {k: n for k, n in report.counts.items() if k in ignored_kinds and n}
    out = ConformanceReport(violations, counts, bytes_bad, ignored, report, policy)
    logger.debug("connector check: %d copy rows, %d zero rows: %s", len(c), len(z),
                 "conforms" if out.ok else ", ".join(f"{k.value} x{n}" for k, n in counts.items() if n))
    return out
