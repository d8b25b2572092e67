"""The ``TOPOLOGY`` note: both sides' stages, DCP token shards and replicas (docs/design.md §11.3).

Worked number: P PP2 x TP4 (80 layers) -> D TP8 notes "P PP2xTP4 (8 ranks), global layers per stage
[0, 40), [40, 80) -> D TP8 (8 ranks)".
"""

from __future__ import annotations

from ..values.engine import EngineGeometry
from ..values.model import StateSpec
from ..values.notes import Note, NoteKind
from ..values.pair import CheckedEngines

__all__ = ["topology_notes", "NOTE_STAGES"]

NOTE_STAGES = 8  # stages listed in the note; beyond that, the first seven, a count, and the last


def _side_topology(e: EngineGeometry) -> str:
    t = e.topology
    text = f"{e.topology.describe(e.tp)} ({e.num_ranks} ranks)"
    if t.pp > 1:
        shown = range(t.pp) if t.pp <= NOTE_STAGES else (*range(NOTE_STAGES - 1), t.pp - 1)
        layers = [str(e.stage_global_layers(s)) for s in shown]
        if t.pp > NOTE_STAGES:
            layers.insert(NOTE_STAGES - 1, f"... ({t.pp - NOTE_STAGES} more)")
        text += f", global layers per stage {', '.join(layers)}"
    if t.dcp > 1:
        text += f", token t on DCP rank (t // {t.interleave}) % {t.dcp} of its head group"
    if t.replicas > 1:
        text += f", {t.replicas} replicas (D ranks spread their reads over them)"
    return text


def topology_notes(pair: CheckedEngines) -> tuple[Note, ...]:
    """One ``TOPOLOGY`` note when either side has stages, DCP or replicas (docs/design.md §11.3)."""
    P, D = pair.prefill, pair.decode
    if P.topology.trivial and D.topology.trivial:
        return ()
    text = f"topology: P {_side_topology(P)} -> D {_side_topology(D)}"
    states = [s.name for s in pair.model.groups if isinstance(s, StateSpec)]
    if states and (P.topology.dcp > 1 or D.topology.dcp > 1):
        text += f"; state groups {states} are not sharded by token (SGLang's DCP leaves request state unchanged)"
    return (Note(NoteKind.TOPOLOGY, text),)
