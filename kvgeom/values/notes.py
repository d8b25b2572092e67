"""Notes: why a plan (or a report, or a transfer) came out as it did, as a kind and a sentence.

The kind is machine-readable (tests and tools match it); the text is for people and may change::

    Note(NoteKind.AUTO_STAGED, "attn: auto: direct 4096 copies = 6144.0 us; staged ... -> staged")
    str(note) == note.text          kinds: see NoteKind, one per decision the planner records

Worked number: a staged plan for one attention group carries one ``SEGMENTS`` note, one ``SOURCES``
note per listed D rank (at most five), one ``STAGED`` note, and one ``ZEROED`` note per zeroed
token interval.
"""

from __future__ import annotations

import enum
from typing import Any

import attrs

__all__ = ["NoteKind", "Note", "as_notes"]


class NoteKind(str, enum.Enum):
    """What a note records."""

    STRATEGY = "strategy"  # the strategy the plan was asked for
    SEGMENTS = "segments"  # an attention group's tokens move in N aligned segments
    NOTHING_TO_MOVE = "nothing_to_move"  # no token is both computed by P and needed by D
    SOURCES = "sources"  # which P ranks a D rank reads which heads from
    ZEROED = "zeroed"  # D tokens that receive nothing and are zeroed
    STAGED = "staged"  # staged: P pages land whole, then rearranges
    STAGED_NOT_APPLICABLE = "staged_not_applicable"  # staged does not apply; direct copies instead
    STAGED_EQUALS_DIRECT = "staged_equals_direct"  # the arrived layout is D's layout
    AUTO_DIRECT = "auto_direct"  # auto weighed the strategies and chose direct
    AUTO_STAGED = "auto_staged"  # auto weighed the strategies and chose staged
    AUTO_PACKED = "auto_packed"  # auto weighed the strategies and chose packed
    AUTO_OVER_BUDGET = "auto_over_budget"  # auto left packed out: its plan would exceed the work budget (§14)
    PACKED = "packed"  # a group moves through staging: pack, wire, unpack (docs/design.md §12)
    CHUNKS = "chunks"  # how a packed plan was cut into chunks, and its staging bytes per rank
    STATE_PAIRS = "state_pairs"  # how a state group's D slots pair with P slots
    STATE_UNPAIRED = "state_unpaired"  # a D slot with no P slot at its token position: not transferred
    TOPOLOGY = "topology"  # pipeline stages, DCP token shards or replicas on either side (docs/design.md §11)
    ROWS_NOT_APPLIED = "rows_not_applied"  # the simulator skipped out-of-bounds rows
    REFERENCE_PATH = "reference_path"  # the compiled pair handed this plan to the reference planner (§13.5)
    PREPPED_FALLBACK = "prepped_fallback"  # the executor posted coalesced lists instead of prepped tables
    INFO = "info"  # anything else (a note given as a plain string)

    def __str__(self) -> str:
        return self.value


@attrs.frozen
class Note:
    """One recorded decision: its ``kind`` and a sentence that says it with the numbers."""

    kind: NoteKind = attrs.field(converter=NoteKind)
    text: str = attrs.field(converter=str)

    def __str__(self) -> str:
        return self.text


def as_notes(value: Any) -> tuple[Note, ...]:
    """attrs converter: notes as given, plain strings becoming ``INFO`` notes."""
    return tuple(v if isinstance(v, Note) else Note(NoteKind.INFO, str(v)) for v in value)
