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

With pipeline stages each layer comes from the P stage holding it, and replicas spread by D rank
(docs/design.md §11.3); DCP does not shard state (SGLang's behaviour), so channel slices stay
those of the full ``tp``.
"""

from __future__ import annotations

import numpy as np

from ..arith.runs import Mode, strided_rows
from ..arith.shard import owned_slice, sources
from ..errors import InternalError
from ..values.layout import StateGroupGeometry
from ..values.model import StateSpec
from ..values.notes import Note, NoteKind
from ..values.pair import CheckedEngines
from ..values.plan import Copies, Zeros
from ..values.request import Request, StateSlots
from .group import GroupPlan
from .rows import Rows
from .sides import stage_parts

__all__ = ["paired_slots", "plan_state_group", "state_rows", "state_notes"]


def paired_slots(request: Request, group: int) -> tuple[list[tuple[int, int, int]], list[tuple[int, int]]]:
    """([(p_slot, d_slot, tokens)], [(unpaired d_slot, tokens)]) in D's listing order."""
    g = request.groups[group]
    if not (isinstance(g.prefill, StateSlots) and isinstance(g.decode, StateSlots)):
        raise InternalError("checked by Pair")
    by_tokens = dict(zip(g.prefill.tokens, g.prefill.slot_ids))
    paired, unpaired = [], []
    for d_slot, t in zip(g.decode.slot_ids, g.decode.tokens):
        if t in by_tokens:
            paired.append((by_tokens[t], d_slot, t))
        else:
            unpaired.append((d_slot, t))
    return paired, unpaired


def state_notes(pair: CheckedEngines, request: Request, group: int) -> list[Note]:
    """How D slots pair with P slots (``STATE_PAIRS``) and every unpaired D slot (``STATE_UNPAIRED``)."""
    spec = pair.model.groups[group]
    paired, unpaired = paired_slots(request, group)
    pgeo, dgeo = pair.prefill.groups[group], pair.decode.groups[group]
    notes = [Note(NoteKind.STATE_PAIRS,
                  f"{spec.name}: state layout P {getattr(pgeo, 'layout', '?')} -> D {getattr(dgeo, 'layout', '?')}; "
                  + (", ".join(f"D slot {ds} <- P slot {ps} (after {t} tokens)" for ps, ds, t in paired)
                     or "no slot pairs"))]
    for ds, t in unpaired:
        notes.append(Note(NoteKind.STATE_UNPAIRED, f"{spec.name}: D slot {ds} (state after {t} tokens) has no P slot "
                          "at that position: not transferred"))
    return notes


def plan_state_group(pair: CheckedEngines, request: Request, group: int) -> GroupPlan:
    """Uncoalesced copies of one state group, plus notes (pairing, layouts, unpaired slots); no zeros."""
    spec = pair.model.groups[group]
    if not isinstance(spec, StateSpec):
        raise InternalError("dispatched on kind")
    paired, _ = paired_slots(request, group)
    notes = state_notes(pair, request, group)
    if not paired:
        return GroupPlan(Copies.empty(), Zeros.empty(), (), notes, 0)
    rows = Rows()
    state_rows(pair, group, np.array([p for p, _, _ in paired], np.int64),
               np.array([d for _, d, _ in paired], np.int64), rows)
    return GroupPlan(rows.copies(), Zeros.empty(), (), notes, rows.count)


def state_rows(pair: CheckedEngines, group: int, p_slots: np.ndarray, d_slots: np.ndarray, rows: Rows) -> None:
    """The copy rows of state group ``group`` for the paired slots ``p_slots[i] -> d_slots[i]``, added
    to ``rows``: per section, D rank, P stage part and source, layer-major over (layer, slot pair)."""
    spec = pair.model.groups[group]
    if not isinstance(spec, StateSpec):
        raise InternalError("dispatched on kind")
    P, D = pair.prefill, pair.decode
    p_places, d_places = P.state_sections(group), D.state_sections(group)
    pgeo, dgeo = P.groups[group], D.groups[group]
    if not (isinstance(pgeo, StateGroupGeometry) and isinstance(dgeo, StateGroupGeometry)):
        raise InternalError("a state group has state geometries on both sides (checked by Pair)")
    # per layer: region, and the start of the layer's state inside a slot's logical page
    p_reg = np.array([v.region for v in pgeo.views], np.int64)
    d_reg = np.array([v.region for v in dgeo.views], np.int64)
    # the logical page of each layer's own (state) region: at most the region's bytes (its pages are whole
    # logical pages), while another region's page_bytes * ppl could pass int64 on a hostile geometry
    p_lpb = np.array([P.logical_page_bytes(int(r)) for r in p_reg], np.int64)
    d_lpb = np.array([D.logical_page_bytes(int(r)) for r in d_reg], np.int64)
    p_view = np.array([v.offset for v in pgeo.views], np.int64)
    d_view = np.array([v.offset for v in dgeo.views], np.int64)
    n_slots = len(p_slots)
    # slot x layer, layer-major like the attention rows
    p_base = (p_slots[None, :] * p_lpb[:, None] + p_view[:, None]).ravel()
    d_base = (d_slots[None, :] * d_lpb[:, None] + d_view[:, None]).ravel()
    p_regs = np.repeat(p_reg, n_slots)
    d_regs = np.repeat(d_reg, n_slots)
    p_reps = P.topology.replicas
    for si, sec in enumerate(spec.sections):
        pp, dp = p_places[si], d_places[si]
        for d in range(D.num_ranks):
            c = D.coords(d)
            d_layers = D.stage_layers(group, c.stage)
            if d_layers.size == 0:
                continue  # this D rank's stage holds none of the group's layers
            d_slice = owned_slice(sec.channels, D.tp, c.tp_rank, replicated=sec.replicated)
            q = d // D.topology.dcp + d % D.topology.dcp  # the spreading key of docs/design.md §11.3
            srcs = sources(sec.channels, p_tp=P.tp, p_replicated=sec.replicated, d_tp=D.tp, d_rank=c.tp_rank,
                           d_replicated=sec.replicated, spread=q // p_reps)
            for p_stage, layers in stage_parts(P, group, d_layers):
                b = slice(layers.start * n_slots, layers.stop * n_slots)  # bases are layer-major
                for src in srcs:
                    p_slice = owned_slice(sec.channels, P.tp, src.p_rank, replicated=sec.replicated)
                    pc0, dc0 = src.items.start - p_slice.start, src.items.start - d_slice.start
                    modes: list[Mode] = [(src.items.size, (pp.channel_stride, dp.channel_stride)),
                                         (sec.rows, (pp.row_stride, dp.row_stride))]
                    (op, od), run, per = strided_rows(
                        sec.unit_bytes, modes,
                        [p_base[b] + pp.offset + pc0 * pp.channel_stride,
                         d_base[b] + dp.offset + dc0 * dp.channel_stride])
                    rows.add(P.rank_of(p_stage, src.p_rank, q % p_reps), np.repeat(p_regs[b], per), op, d,
                             np.repeat(d_regs[b], per), od, np.asarray(run, np.int64))
