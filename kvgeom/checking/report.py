"""The simulator's verdict: what kind of problem, where, and how many (docs/design.md §7).

Each check reports into a sink that counts every violation exactly but keeps only the first few
of each kind for the listing, so a plan that writes a million foreign bytes costs a counter, not a
million objects::

    check --add(kind, count, nbytes, make)--> Sink  --report(bytes_checked)--> Report
                                              counts[kind]  += count           violations (listed)
                                              bytes_bad[kind] += nbytes        counts, bytes_bad (exact)
                                              items += make(i) for the first   notes (Note, NoteKind)
                                                       LIST_LIMIT of the kind

The kinds map onto the invariants of docs/design.md §4.2: OUT_OF_BOUNDS, FOREIGN_WRITE and
FOREIGN_READ break invariant 1 (confined), OVERLAPPING_WRITE invariant 2, MISSING and WRONG_DATA
invariant 3, NOT_ZEROED and CLOBBERED (and WRONG_DATA on a must-be-zero byte) invariant 4 (BEYOND_COMPUTED
too: a must-be-zero byte at or past M holding written bytes, under the ``beyond_computed`` policy), NOT_MINIMAL
invariant 5, NONDETERMINISTIC invariant 6, and the staging kinds of packed plans
(STAGING_OUT_OF_SLOT, STAGING_OVERLAP, STALE_STAGING) invariant 7 (an OUT_OF_BOUNDS row leaves the
engines altogether and is not applied).

Worked number: 32 copy rows that write outside the listed D pages give ``counts[FOREIGN_WRITE] ==
32`` and ``bytes_bad`` their summed lengths, but ``LIST_LIMIT = 20`` listed violations of that kind.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from typing import Any

import attrs

from ..values.notes import Note, as_notes

__all__ = ["ViolationKind", "Violation", "Report"]

LIST_LIMIT = 20  # violations listed per kind in a Report (counts stay exact)


class ViolationKind(str, enum.Enum):
    """What is wrong; plan-level kinds first, then content kinds (checked on D bytes)."""

    OUT_OF_BOUNDS = "out_of_bounds"  # a rank, region, page or byte range outside the engine
    FOREIGN_WRITE = "foreign_write"  # a D write outside the request's listed D pages (or into held prefix pages)
    FOREIGN_READ = "foreign_read"  # a P read outside the listed P pages (or a rearrange read outside D's)
    OVERLAPPING_WRITE = "overlapping_write"  # two copies (or two rearrange elements) write one D byte
    NOT_MINIMAL = "not_minimal"  # two copies (or two zeros) could merge
    NONDETERMINISTIC = "nondeterministic"  # planning twice gave a different plan
    STAGING_OUT_OF_SLOT = "staging_out_of_slot"  # a pack, wire row or unpack leaves its chunk's slot (or chunk)
    STAGING_OVERLAP = "staging_overlap"  # two packs (or two wire rows) of one chunk write one staging byte
    STALE_STAGING = "stale_staging"  # a wire row / unpack reads staging bytes its chunk did not write
    WRONG_DATA = "wrong_data"  # a needed or must-be-zero byte holds something else
    MISSING = "missing"  # a needed byte still holds D's stale pattern
    NOT_ZEROED = "not_zeroed"  # a must-be-zero byte still holds D's stale pattern
    CLOBBERED = "clobbered"  # a byte that must stay untouched changed
    BEYOND_COMPUTED = "beyond_computed"  # a D token at or past M (never computed by P) holds non-zero bytes

    def __str__(self) -> str:
        return self.value


@attrs.frozen
class Violation:
    """One problem: where (side, rank, region, byte offset, length), which coordinate, and why."""

    kind: ViolationKind
    side: str  # "prefill" or "decode"
    rank: int
    region: int
    offset: int
    nbytes: int
    coordinate: str = ""
    detail: str = ""

    def __str__(self) -> str:
        where = f"{self.side} rank {self.rank} region {self.region} bytes [{self.offset}, {self.offset + self.nbytes})"
        coord = f" {self.coordinate}" if self.coordinate else ""
        detail = f": {self.detail}" if self.detail else ""
        return f"{self.kind.value}: {where}{coord}{detail}"


@attrs.frozen
class Report:
    """The simulator's verdict. ``violations`` lists at most ``LIST_LIMIT`` per kind; ``counts``
    and ``bytes_bad`` are exact. ``bytes_checked`` is the number of D bytes compared. ``notes``
    say what the simulator did beyond checking (e.g. ``NoteKind.ROWS_NOT_APPLIED``)."""

    violations: tuple[Violation, ...]
    counts: dict[ViolationKind, int]
    bytes_checked: int
    bytes_bad: dict[ViolationKind, int] = attrs.field(factory=dict)
    notes: tuple[Note, ...] = attrs.field(default=(), converter=as_notes)

    @property
    def ok(self) -> bool:
        return not any(self.counts.values())

    def of_kind(self, kind: ViolationKind) -> tuple[Violation, ...]:
        return tuple(v for v in self.violations if v.kind is kind)

    def __str__(self) -> str:
        if self.ok:
            return f"OK: {self.bytes_checked} D bytes checked, no violations"
        parts = [f"{k.value} x{n} ({self.bytes_bad.get(k, 0)} B)" for k, n in self.counts.items() if n]
        lines = [f"FAILED: {', '.join(parts)}; {self.bytes_checked} D bytes checked"]
        shown: set[ViolationKind] = set()
        for v in self.violations:
            if v.kind not in shown:
                shown.add(v.kind)
                lines.append(f"  {v}")
        lines.extend(f"  note: {n.text}" for n in self.notes)
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready: notes as their texts, with their kinds in the parallel list ``note_kinds``."""
        return {
            "ok": self.ok,
            "bytes_checked": self.bytes_checked,
            "counts": {k.value: n for k, n in self.counts.items()},
            "bytes_bad": {k.value: n for k, n in self.bytes_bad.items()},
            "violations": [dict(attrs.asdict(v), kind=v.kind.value) for v in self.violations],
            "notes": [n.text for n in self.notes],
            "note_kinds": [n.kind.value for n in self.notes],
        }


class Sink:
    """Counts every violation; keeps the first ``limit`` of each kind (all when ``limit`` is None).

    Package-internal (not in ``__all__``): the checks report into it, :func:`simulate` turns it
    into a :class:`Report`.
    """

    def __init__(self, limit: int | None) -> None:
        self.limit = limit
        self.items: list[Violation] = []
        self.counts: dict[ViolationKind, int] = {}
        self.bytes_bad: dict[ViolationKind, int] = {}
        self.notes: list[Note] = []

    def add(self, kind: ViolationKind, count: int, nbytes: int, make: Callable[[int], Violation]) -> None:
        """Record ``count`` violations of ``kind``; ``make(i)`` builds the i-th for the listing."""
        if count <= 0:
            return
        listed = sum(1 for v in self.items if v.kind is kind)
        room = count if self.limit is None else max(0, min(count, self.limit - listed))
        self.items.extend(make(i) for i in range(room))
        self.counts[kind] = self.counts.get(kind, 0) + count
        self.bytes_bad[kind] = self.bytes_bad.get(kind, 0) + nbytes

    def one(self, violation: Violation, nbytes: int = 0) -> None:
        self.add(violation.kind, 1, nbytes, lambda _i: violation)

    def report(self, bytes_checked: int) -> Report:
        order = list(ViolationKind)
        items = sorted(self.items, key=lambda v: order.index(v.kind))
        return Report(tuple(items), {k: self.counts[k] for k in order if k in self.counts}, bytes_checked,
                      {k: self.bytes_bad[k] for k in order if k in self.bytes_bad}, tuple(self.notes))
