"""The rank pairs of a packed plan (docs/design.md §12, §12.2): per group, the (D rank, source P rank)
pairs that exchange bytes and the slices each carries (:class:`_Slice`: its heads or channels, its
planes and their bytes per token or slot), how two slices overlap, and a state pair's sections.
"""

from __future__ import annotations

import attrs
import numpy as np

from ..arith.shard import owned_slice, sources
from ..errors import InternalError
from ..values.model import AttentionSpec, StateSpec
from ..values.pair import CheckedEngines
from ..values.request import Request
from ..values.staging import ChunkPiece
from .attention import needed_tokens
from .sides import stage_parts
from .state import paired_slots


@attrs.frozen
class _Slice:
    """What flat P rank ``p`` sends flat D rank ``d`` in one group: layers ``[l0, l1)``, ``n``
    items (heads or channels) starting at local item ``p0`` on P and ``d0`` on D, and (attention)
    the tokens D's DCP rank ``dr`` and P's DCP rank ``po`` both own."""

    p: int
    d: int
    n: int
    p0: int
    d0: int
    l0: int
    l1: int
    dr: int = 0
    po: int = 0


@attrs.frozen(eq=False)
class _Group:
    """What one group moves, per (P rank, D rank) pair."""

    index: int
    layers: int
    attention: bool
    lo: int = 0  # attention: tokens [lo, hi)
    hi: int = 0
    unit: int = 0  # attention: bytes of one token of one layer per item (planes * head_bytes)
    pairs: tuple[_Slice, ...] = ()  # attention
    sections: tuple[tuple[_Slice, ...], ...] = ()  # state: per section
    section_bytes: tuple[int, ...] = ()  # state: bytes of one channel of one section (rows * unit) x paired slots
    p_slots: tuple[int, ...] = ()
    d_slots: tuple[int, ...] = ()


def _attention_pairs(pair: CheckedEngines, g: int, spec: AttentionSpec) -> tuple[_Slice, ...]:
    """Every (P rank, D rank) pair of an attention group (the direct planner's rule, §11.3)."""
    P, D = pair.prefill, pair.decode
    H = spec.num_kv_heads
    p_dcp, d_dcp, p_reps = P.topology.dcp, D.topology.dcp, P.topology.replicas
    out = []
    for d in range(D.num_ranks):
        c = D.coords(d)
        d_layers = D.stage_layers(g, c.stage)
        if d_layers.size == 0:
            continue
        d_slice = D.head_slice(g, d)
        q = d // d_dcp + d % d_dcp  # the spreading key of docs/design.md §11.3
        srcs = sources(H, p_tp=P.head_tp, p_replicated=spec.replicated, d_tp=D.head_tp, d_rank=c.head_group,
                       d_replicated=spec.replicated, spread=q // p_reps)
        for p_stage, layers in stage_parts(P, g, d_layers):
            for po in range(p_dcp):
                for src in srcs:
                    p = P.rank_of(p_stage, src.p_rank * p_dcp + po, q % p_reps)
                    p_slice = owned_slice(H, P.head_tp, src.p_rank, replicated=spec.replicated)
                    out.append(_Slice(p, d, src.items.size, src.items.start - p_slice.start,
                                      src.items.start - d_slice.start, layers.start, layers.stop, c.dcp_rank, po))
    return tuple(sorted(out, key=lambda s: (s.d, s.p)))


def _state_pairs(pair: CheckedEngines, g: int, spec: StateSpec) -> tuple[tuple[_Slice, ...], ...]:
    """Per section, every (P rank, D rank) pair of a state group (channels over the full TP, §11.3)."""
    P, D = pair.prefill, pair.decode
    p_reps = P.topology.replicas
    out = []
    for sec in spec.sections:
        pairs = []
        for d in range(D.num_ranks):
            c = D.coords(d)
            d_layers = D.stage_layers(g, c.stage)
            if d_layers.size == 0:
                continue
            d_slice = owned_slice(sec.channels, D.tp, c.tp_rank, replicated=sec.replicated)
            q = d // D.topology.dcp + d % D.topology.dcp
            srcs = sources(sec.channels, p_tp=P.tp, p_replicated=sec.replicated, d_tp=D.tp, d_rank=c.tp_rank,
                           d_replicated=sec.replicated, spread=q // p_reps)
            for p_stage, layers in stage_parts(P, g, d_layers):
                for src in srcs:
                    p_slice = owned_slice(sec.channels, P.tp, src.p_rank, replicated=sec.replicated)
                    pairs.append(_Slice(P.rank_of(p_stage, src.p_rank, q % p_reps), d, src.items.size,
                                        src.items.start - p_slice.start, src.items.start - d_slice.start,
                                        layers.start, layers.stop))
        out.append(tuple(sorted(pairs, key=lambda s: (s.d, s.p))))
    return tuple(out)


def _groups(pair: CheckedEngines, request: Request) -> list[_Group]:
    out: list[_Group] = []
    for gi, spec in enumerate(pair.model.groups):
        if isinstance(spec, AttentionSpec):
            lo, hi = needed_tokens(request, pair, gi)
            pairs = _attention_pairs(pair, gi, spec) if hi > lo else ()
            out.append(_Group(gi, spec.num_layers, True, lo, max(lo, hi), spec.planes * spec.head_bytes, pairs))
        elif isinstance(spec, StateSpec):
            paired, _ = paired_slots(request, gi)
            secs = _state_pairs(pair, gi, spec) if paired else tuple(() for _ in spec.sections)
            out.append(_Group(gi, spec.num_layers, False, sections=secs,
                              section_bytes=tuple(len(paired) * s.rows * s.unit_bytes for s in spec.sections),
                              p_slots=tuple(p for p, _, _ in paired), d_slots=tuple(d for _, d, _ in paired)))
        else:
            raise InternalError("a group is attention or state")
    return out


# ---- the staging layout of one piece --------------------------------------------------------------------

def _overlap(s: _Slice, piece: ChunkPiece) -> tuple[int, int]:
    """The layers of ``piece`` pair ``s`` carries: ``[l0, l1)`` (empty when l0 >= l1)."""
    return max(s.l0, piece.layer_start), min(s.l1, piece.layer_stop)


def _state_pair_sections(g: _Group, piece: ChunkPiece, p: int, d: int) -> list[tuple[int, _Slice]]:
    out = []
    for si in range(piece.section_start, piece.section_stop):
        for s in g.sections[si]:
            l0, l1 = _overlap(s, piece)
            if s.p == p and s.d == d and l1 > l0:
                out.append((si, s))
    return out


def _by_page_bytes(regions: np.ndarray, page_bytes: np.ndarray) -> list[np.ndarray]:
    """Layer-entry indices grouped by their region's page size (one step per group)."""
    sizes = page_bytes[regions]
    return [np.flatnonzero(sizes == v) for v in np.unique(sizes)]

