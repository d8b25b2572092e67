"""What planning one group returns: its uncoalesced rows, its rearranges and its notes, by name.

    GroupPlan(copies, zeros, rearranges, notes, rows_before_coalescing)
      copies / zeros   uncoalesced columns (the transfer coalesces all groups once)
      rearranges       staged only: in-place permutations of D pages
      rows_before...   copy rows before coalescing (counted even when the rows are not built)

Worked number: one attention group planned with ``materialize=False`` for 4096 rows returns empty
columns and ``rows_before_coalescing == 4096`` (what ``auto`` compares).
"""

from __future__ import annotations

from typing import Any

import attrs

from ..values.notes import Note, as_notes
from ..values.plan import Copies, Rearrange, Zeros

__all__ = ["GroupPlan"]


def _rearranges(value: Any) -> tuple[Rearrange, ...]:
    return tuple(value)


@attrs.frozen(eq=False)
class GroupPlan:
    """One group's part of a plan, before coalescing."""

    copies: Copies
    zeros: Zeros
    rearranges: tuple[Rearrange, ...] = attrs.field(default=(), converter=_rearranges)
    notes: tuple[Note, ...] = attrs.field(default=(), converter=as_notes)
    rows_before_coalescing: int = 0

    def with_notes(self, *notes: Note) -> GroupPlan:
        """The same plan with ``notes`` appended."""
        return attrs.evolve(self, notes=self.notes + notes)
