"""The reference simulator: applies a plan to byte buffers filled from the model and checks every invariant.

It never imports the planner (it is the oracle the planner is checked against).
"""

from __future__ import annotations

from .simulator import (
    Memory,
    Report,
    Violation,
    ViolationKind,
    apply_plan,
    attention_hash,
    check_decode,
    check_plan,
    coordinate_hash,
    describe,
    fill_decode,
    fill_prefill,
    listed_pages,
    pattern_bytes,
    simulate,
    state_hash,
    writable_pages,
)

__all__ = [
    "writable_pages",
    "ViolationKind",
    "Violation",
    "Report",
    "Memory",
    "coordinate_hash",
    "attention_hash",
    "state_hash",
    "pattern_bytes",
    "listed_pages",
    "describe",
    "fill_prefill",
    "fill_decode",
    "apply_plan",
    "check_plan",
    "check_decode",
    "simulate",
]
