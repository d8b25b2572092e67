"""Direct copies for state groups (mamba / linear attention): slots paired by token position,
sections sharded by channel slices.

A state is indivisible along tokens: D slot ``j`` receives P slot ``i`` only when both hold the
state after the same number of tokens. Each section is a ``[channels, rows, unit]`` array; a D
rank's channel slice is gathered from the P ranks whose slices intersect it::

    section x, 8 channels     0 1 2 3 4 5 6 7
    P TP4 slices              [P0][P1][P2][P3]
    D TP2 slices              [  D0  ][  D1  ]     D1 <- P2 channels [4, 6), P3 channels [6, 8)

channel_major pages keep a slice contiguous (one run per section per source); state_major pages
store ``[rows, channels]`` so a slice is one run per row. Plans never zero state bytes.

Worked number: Mamba2 ``x`` with 4096 channels, 3 rows of 2 B, P TP4 -> D TP2 channel_major:
D rank 1 reads 1024 * 3 * 2 = 6144 B from each of P ranks 2 and 3 per layer.
"""

from __future__ import annotations

import numpy as np

from .model import StateSpec
from .pair import Pair
from .plan import Copies
from .request import Request, StateSlots
from .runs import strided_rows
from .shard import owned_slice, sources

__all__ = ["paired_slots", "plan_state_group"]


def paired_slots(request: Request, group: int) -> tuple[list[tuple[int, int, int]], list[tuple[int, int]]]:
    """([(p_slot, d_slot, tokens)], [(unpaired d_slot, tokens)]) in D's listing order."""
    g = request.groups[group]
    assert isinstance(g.prefill, StateSlots) and isinstance(g.decode, StateSlots)  # noqa: S101 - checked by Pair
    by_tokens = dict(zip(g.prefill.tokens, g.prefill.slot_ids))
    paired, unpaired = [], []
    for d_slot, t in zip(g.decode.slot_ids, g.decode.tokens):
        if t in by_tokens:
            paired.append((by_tokens[t], d_slot, t))
        else:
            unpaired.append((d_slot, t))
    return paired, unpaired


def plan_state_group(pair: Pair, request: Request, group: int) -> tuple[Copies, list[str]]:
    """Uncoalesced copies of one state group, plus notes (pairing, layouts, unpaired slots)."""
    spec = pair.model.groups[group]
    assert isinstance(spec, StateSpec)  # noqa: S101 - dispatched on kind
    P, D = pair.prefill, pair.decode
    paired, unpaired = paired_slots(request, group)
    notes = []
    pgeo, dgeo = P.groups[group], D.groups[group]
    notes.append(f"{spec.name}: state layout P {getattr(pgeo, 'layout', '?')} -> D {getattr(dgeo, 'layout', '?')}; "
                 + (", ".join(f"D slot {ds} <- P slot {ps} (after {t} tokens)" for ps, ds, t in paired)
                    or "no slot pairs"))
    for ds, t in unpaired:
        notes.append(f"{spec.name}: D slot {ds} (state after {t} tokens) has no P slot at that position: "
                     "not transferred")
    if not paired:
        return Copies.empty(), notes
    p_slots = np.array([p for p, _, _ in paired], np.int64)
    d_slots = np.array([d for _, d, _ in paired], np.int64)
    p_places, d_places = P.state_sections(group), D.state_sections(group)
    parts: list[Copies] = []
    for si, sec in enumerate(spec.sections):
        pp, dp = p_places[si], d_places[si]
        for d in range(D.tp):
            d_slice = owned_slice(sec.channels, D.tp, d, replicated=sec.replicated)
            for src in sources(sec.channels, p_tp=P.tp, p_replicated=sec.replicated, d_tp=D.tp, d_rank=d,
                               d_replicated=sec.replicated):
                p_slice = owned_slice(sec.channels, P.tp, src.p_rank, replicated=sec.replicated)
                pc0, dc0 = src.items.start - p_slice.start, src.items.start - d_slice.start
                for layer in range(spec.num_layers):
                    rp, bp = P.state_address(group, layer, si, p_slots, pc0, 0)
                    rd, bd = D.state_address(group, layer, si, d_slots, dc0, 0)
                    modes = [(src.items.size, (pp.channel_stride, dp.channel_stride)),
                             (sec.rows, (pp.row_stride, dp.row_stride))]
                    (op, od), run, _ = strided_rows(sec.unit_bytes, modes, [bp, bd])
                    rows = len(op)
                    parts.append(Copies(np.full(rows, src.p_rank, np.int64), np.full(rows, rp, np.int64), op,
                                        np.full(rows, d, np.int64), np.full(rows, rd, np.int64), od,
                                        np.full(rows, run, np.int64)))
    return Copies.concat(parts), notes
