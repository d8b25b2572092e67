"""The reference simulator (docs/design.md §7): applies a plan to byte buffers filled from the model
and checks every invariant of docs/design.md §4.2.

It never imports the planner (it is the oracle the planner is checked against). The modules, one
job each, are listed in :mod:`kvgeom.checking.simulator`'s docstring.
"""

from __future__ import annotations

from .apply import apply_plan
from .content import BEYOND_COMPUTED_POLICIES, check_decode
from .describe import ByteCoordinate, describe, locate_byte
from .fill import fill_decode, fill_prefill
from .hashing import attention_hash, coordinate_hash, pattern_bytes, state_hash
from .memory import MAX_ALLOCATED_BYTES, Memory
from .plan_checks import check_plan
from .report import Report, Violation, ViolationKind
from .simulator import simulate
from .walk import listed_pages, writable_pages

__all__ = [
    "writable_pages",
    "ViolationKind",
    "Violation",
    "Report",
    "Memory",
    "MAX_ALLOCATED_BYTES",
    "coordinate_hash",
    "attention_hash",
    "state_hash",
    "pattern_bytes",
    "listed_pages",
    "describe",
    "locate_byte",
    "ByteCoordinate",
    "fill_prefill",
    "fill_decode",
    "apply_plan",
    "check_plan",
    "check_decode",
    "BEYOND_COMPUTED_POLICIES",
    "simulate",
]
