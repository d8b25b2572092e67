"""The cells of a transfer drawing (docs/design.md §11): :func:`transfer_cells` turns one rank's
view of a request into rows of cell codes (:class:`CellMap`, :class:`Row`), per group, layer run,
plane and head run (attention) or slot, layer and section (state), each cell the source found by
:mod:`kvgeom.show.cell_sources`; rows identical across heads, then planes, then layers merge, and past
``max_cells`` tokens a cell shows the majority source of its tokens (sampled past a budget).
matplotlib is not needed here: :mod:`kvgeom.show.drawing` paints the cells.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import attrs
import numpy as np

from ..arith.tokens import locate
from ..errors import value_text
from ..values.engine import EngineGeometry
from ..values.model import AttentionSpec, StateSpec
from ..values.notes import NoteKind
from ..values.plan import TransferPlan
from ..values.request import BlockList, Request, StateSlots
from .cell_sources import SOURCE_STRIDE, UNTOUCHED, ZEROED, DrawError, _Resolver

NOT_LISTED = -3  # outside the group's listed blocks on this side: not drawn
_FULL_BUDGET = 1 << 22  # coordinates evaluated exactly; past this, each binned cell is sampled
_STATE_CELLS = 64  # most cells of a state row


@attrs.frozen(eq=False)
class Row:
    """One drawn row: its label, group, kind and per-cell ``codes`` and ``zero_fraction``."""

    label: str
    group: int
    kind: str  # "attention" or "state"
    rank: int
    codes: np.ndarray  # int64: a source code (>= 0) or UNTOUCHED / ZEROED / NOT_LISTED
    zero_fraction: np.ndarray  # float: share of the cell's tokens that are zeroed


@attrs.frozen(eq=False)
class CellMap:
    """Everything :func:`draw` renders: rows of cells over ``[token_lo, token_hi)``."""

    side: str
    rows: tuple[Row, ...]
    token_lo: int
    token_hi: int
    tokens_per_cell: int
    blocks: tuple[tuple[int, int, int, tuple[int, ...]], ...]  # per attention group: (group, first, B, ids)
    sampled: bool  # binned cells were estimated from a sample of their tokens
    title: str

    @property
    def cells(self) -> int:
        return -(-(self.token_hi - self.token_lo) // self.tokens_per_cell) if self.token_hi > self.token_lo else 0

    def sources(self) -> list[tuple[int, int]]:
        """Distinct (rank, position) of the source codes present, sorted."""
        codes = np.unique(np.concatenate([r.codes for r in self.rows])) if self.rows else np.zeros(0, np.int64)
        return [(int(c) // SOURCE_STRIDE, int(c) % SOURCE_STRIDE) for c in codes if c >= 0]

    def ranks(self) -> list[int]:
        """Distinct source ranks (P ranks in the decode view, reading D ranks in the prefill view)."""
        return sorted({r for r, _ in self.sources()})


# ---- cells ----------------------------------------------------------------------------------------------


def _sample_tokens(lo: int, hi: int, max_cells: int, rows: int) -> tuple[int, np.ndarray, bool]:
    """(tokens per cell, sampled tokens as [cells, k], sampled?)."""
    span = hi - lo
    if span <= 0:
        return 1, np.zeros((0, 1), np.int64), False
    tpc = max(1, -(-span // max_cells))
    cells = -(-span // tpc)
    if rows * span <= _FULL_BUDGET or tpc == 1:
        k, sampled = tpc, False
    else:
        k, sampled = max(2, min(tpc, _FULL_BUDGET // max(1, rows * cells))), True
    offs = np.unique(np.linspace(0, tpc - 1, k).round().astype(np.int64)) if sampled else np.arange(tpc)
    tok = lo + np.arange(cells)[:, None] * tpc + offs[None, :]
    return tpc, np.where(tok < hi, tok, -1), sampled


def _reduce(codes: np.ndarray, zeroed: np.ndarray, valid: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per cell (last axis = the cell's sampled tokens): majority source, else ZEROED/UNTOUCHED/NOT_LISTED,
    and the zeroed fraction of its listed tokens."""
    listed = valid.sum(-1)
    zf = np.where(listed > 0, (zeroed & valid).sum(-1) / np.maximum(listed, 1), 0.0)
    src = (codes >= 0) & valid
    if codes.shape[-1] == 1:
        out = np.where(valid[..., 0], codes[..., 0], NOT_LISTED)
        return out, zf
    # the mode of each cell's source codes: sort, then the longest run of equal codes
    k = codes.shape[-1]
    s = np.sort(np.where(src, codes, -1), axis=-1)
    change = np.ones(s.shape, bool)
    change[..., 1:] = s[..., 1:] != s[..., :-1]
    idx = np.arange(k)
    run_start = np.maximum.accumulate(np.where(change, idx, 0), axis=-1)
    run = np.where(s >= 0, idx - run_start + 1, 0)
    best = np.take_along_axis(s, run.argmax(-1)[..., None], -1)[..., 0]
    any_zero = (zeroed & valid).any(-1)
    out = np.where(src.any(-1), best, np.where(any_zero, ZEROED, np.where(listed > 0, UNTOUCHED, NOT_LISTED)))
    return out, zf


def _span(ids: Sequence[int], first: int, B: int) -> tuple[int, int]:
    return first, first + len(ids) * B


def _locate(engine: EngineGeometry, listing: BlockList, tokens: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(valid, kernel page, slot) of global tokens on a side's listing."""
    B, K, ppl = engine.logical_block_tokens, engine.kernel_block_tokens, engine.blocks_per_logical
    lo, hi = _span(listing.block_ids, listing.first_token, B)
    valid = (tokens >= lo) & (tokens < hi)
    if not listing.block_ids:
        zero = np.zeros_like(tokens)
        return valid, zero, zero
    page, slot = locate(np.asarray(listing.block_ids, np.int64), listing.first_token, K, ppl,
                        np.where(valid, tokens, listing.first_token), engine.topology.dcp, engine.topology.interleave)
    return valid, page, slot


def _ranges(values: Sequence[int]) -> str:
    vals = list(values)
    if not vals:
        return ""
    parts, start, prev = [], vals[0], vals[0]
    for v in vals[1:] + [None]:  # type: ignore[list-item]
        if v is not None and v == prev + 1:
            prev = v
            continue
        parts.append(f"{start}" if start == prev else f"{start}-{prev}")
        if v is not None:
            start = prev = v
    return ",".join(parts)


def _same(a: list[tuple[Any, np.ndarray, np.ndarray]], b: list[tuple[Any, np.ndarray, np.ndarray]]) -> bool:
    return len(a) == len(b) and all(x[0] == y[0] and np.array_equal(x[1], y[1]) and np.allclose(x[2], y[2])
                                    for x, y in zip(a, b))


def _merge_runs(items: list[tuple[int, np.ndarray, np.ndarray]]) -> list[tuple[tuple[int, ...], np.ndarray, np.ndarray]]:
    """Consecutive items with equal cells merge: [(indices, codes, zf)]."""
    out: list[tuple[tuple[int, ...], np.ndarray, np.ndarray]] = []
    for i, c, z in items:
        if out and np.array_equal(out[-1][1], c) and np.allclose(out[-1][2], z):
            out[-1] = (out[-1][0] + (i,), out[-1][1], out[-1][2])
        else:
            out.append(((i,), c, z))
    return out


def _merge_layers(per_layer: list[list[tuple[Any, np.ndarray, np.ndarray]]]) -> list[tuple[list[int], list[Any]]]:
    out: list[tuple[list[int], list[Any]]] = []
    for li, struct in enumerate(per_layer):
        if out and _same(out[-1][1], struct):
            out[-1][0].append(li)
        else:
            out.append(([li], struct))
    return out


def transfer_cells(
    plan: TransferPlan,
    pair: Any,
    request: Request,
    *,
    side: str = "decode",
    rank: int | None = None,
    max_cells: int = 256,
) -> CellMap:
    """The cells :func:`draw` renders (see the module docstring), for tests and custom plots."""
    if side not in ("decode", "prefill"):
        raise DrawError("side", f"unknown side {value_text(side, 60)}", actual=side, expected=["decode", "prefill"])
    P, D = pair.prefill, pair.decode
    engine = D if side == "decode" else P
    if rank is not None and not (isinstance(rank, int) and 0 <= rank < engine.num_ranks):
        what = f"tp={engine.tp}" if engine.topology.trivial else f"{engine.num_ranks} ranks"
        raise DrawError("rank", f"rank {value_text(rank, 60)} is outside the {side} engine's {what}", actual=rank,
                        expected=f"0 <= rank < {engine.num_ranks} or None (all ranks)")
    if not isinstance(max_cells, int) or max_cells < 1:
        raise DrawError("max_cells", f"must be a positive int, got {value_text(max_cells, 60)}", actual=max_cells, expected=">= 1")
    res = _Resolver(plan, P, D)
    ranks = range(engine.num_ranks) if rank is None else (rank,)
    model = engine.model
    letter = "d" if side == "decode" else "p"

    spans = []
    for g, spec in enumerate(model.groups):
        listing = getattr(request.groups[g], side)
        if isinstance(spec, AttentionSpec) and isinstance(listing, BlockList):
            spans.append(_span(listing.block_ids, listing.first_token, engine.logical_block_tokens))
    lo = min((a for a, b in spans if b > a), default=0)
    hi = max((b for a, b in spans if b > a), default=0)
    est_rows = sum(spec.num_layers * spec.planes * engine.local_heads(g)
                   for g, spec in enumerate(model.groups) if isinstance(spec, AttentionSpec)) * len(ranks)
    tpc, tok, sampled = _sample_tokens(lo, hi, max_cells, max(1, est_rows))
    rows: list[Row] = []
    blocks: list[tuple[int, int, int, tuple[int, ...]]] = []
    for r in ranks:
        for g, spec in enumerate(model.groups):
            gr = request.groups[g]
            listing = getattr(gr, side)
            if isinstance(spec, AttentionSpec) and isinstance(listing, BlockList):
                if r == ranks[0]:
                    blocks.append((g, listing.first_token, engine.logical_block_tokens, listing.block_ids))
                rows.extend(_attention_rows(res, side, engine, g, spec, r, listing, gr.prefill, tok, letter))
            elif isinstance(spec, StateSpec) and isinstance(listing, StateSlots):
                rows.extend(_state_rows(res, side, engine, g, spec, r, listing, gr.prefill, letter))
    strategy = next((n.text.split(" ", 1)[-1] for n in plan.notes if n.kind is NoteKind.STRATEGY), "?")
    title = (f"{side} view, {'all ranks' if rank is None else f'{letter.upper()} rank {rank}'}: "
             f"P {P.topology.describe(P.tp)} K={P.kernel_block_tokens} ppl={P.blocks_per_logical} -> "
             f"D {D.topology.describe(D.tp)} K={D.kernel_block_tokens} ppl={D.blocks_per_logical}; "
             f"M={request.computed_tokens} S={request.prefix_hit_tokens}; strategy {strategy}")
    if tpc > 1:
        title += f"; {tpc} tokens per cell" + (" (sampled)" if sampled else "")
    return CellMap(side, tuple(rows), lo, hi, tpc, tuple(blocks), sampled, title)


def _attention_rows(res: _Resolver, side: str, engine: EngineGeometry, g: int, spec: AttentionSpec, rank: int,
                    listing: BlockList, p_listing: Any, tok: np.ndarray, letter: str) -> list[Row]:
    holds = engine.holds(rank)[spec.name]
    held, layers, shard = holds["heads"], holds["layers"], holds["tokens"]
    heads = np.arange(held.size, dtype=np.int64)
    flat = tok.ravel()
    valid, page, slot = _locate(engine, listing, np.where(flat >= 0, flat, 0))
    valid &= flat >= 0
    if shard.size > 1:  # a DCP rank draws only its own tokens
        valid &= (flat // shard.interleave) % shard.size == shard.rank
    per_layer: list[list[tuple[Any, np.ndarray, np.ndarray]]] = []
    for layer in range(layers.start, layers.stop):
        planes: list[list[tuple[tuple[int, ...], np.ndarray, np.ndarray]]] = []
        for plane in range(spec.planes):
            region, starts = engine.attention_address(g, layer, plane, page[:, None], slot[:, None], heads[None, :])
            if side == "decode":
                codes, zeroed = res.decode_sources(rank, region, starts, p_listing, "attention")
            else:
                codes = res.prefill_readers(rank, region, starts)
                zeroed = np.zeros(codes.shape, bool)
            shape = tok.shape + (held.size,)
            c3 = np.where(valid[:, None], codes, NOT_LISTED).reshape(shape)
            z3 = (zeroed & valid[:, None]).reshape(shape)
            v3 = np.broadcast_to(valid[:, None], codes.shape).reshape(shape)
            cells, zf = _reduce(np.moveaxis(c3, 2, 0), np.moveaxis(z3, 2, 0), np.moveaxis(v3, 2, 0))
            planes.append(_merge_runs([(h, cells[h], zf[h]) for h in range(held.size)]))
        if spec.planes == 2 and _same(planes[0], planes[1]):  # type: ignore[arg-type]
            per_layer.append([(("K,V", idx), c, z) for idx, c, z in planes[0]])
        else:
            names = ("latent",) if spec.planes == 1 else ("K", "V")
            per_layer.append([((names[p], idx), c, z) for p, runs in enumerate(planes) for idx, c, z in runs])
    out = []
    who = _rank_label(engine, letter, rank)
    token_text = "" if shard.size == 1 else f" tokens {shard}"
    for merged, struct in _merge_layers(per_layer):
        for (pname, idx), c, z in struct:
            head_text = "" if spec.kind.value == "mla" else " h" + _ranges([held.start + i for i in idx])
            out.append(Row(f"{who} {spec.name} L{_ranges([layers.start + i for i in merged])} {pname}{head_text}"
                           f"{token_text}", g, "attention", rank, c, z))
    return out


def _rank_label(engine: EngineGeometry, letter: str, rank: int) -> str:
    """``d3``; ``p5[s1]`` on a multi-stage engine (the rank's pipeline stage)."""
    if engine.topology.pp == 1:
        return f"{letter}{rank}"
    return f"{letter}{rank}[s{engine.coords(rank).stage}]"


def _state_rows(res: _Resolver, side: str, engine: EngineGeometry, g: int, spec: StateSpec, rank: int,
                listing: StateSlots, p_listing: Any, letter: str) -> list[Row]:
    out = []
    holds = engine.holds(rank)[spec.name]
    layers = holds["layers"]
    who = _rank_label(engine, letter, rank)
    for slot_id, tokens in zip(listing.slot_ids, listing.tokens):
        for si, sec in enumerate(spec.sections):
            held = holds[sec.name]
            n = held.size
            per = max(1, -(-n // _STATE_CELLS))
            cells = -(-n // per)
            ch = np.arange(cells)[:, None] * per + np.arange(per)[None, :]
            valid = ch < n
            per_layer: list[list[tuple[Any, np.ndarray, np.ndarray]]] = []
            for layer in range(layers.start, layers.stop):
                region, starts = engine.state_address(g, layer, si, slot_id, np.where(valid, ch, 0), 0)
                if side == "decode":
                    codes, zeroed = res.decode_sources(rank, region, starts, p_listing, "state")
                else:
                    codes = res.prefill_readers(rank, region, starts)
                    zeroed = np.zeros(codes.shape, bool)
                c, z = _reduce(np.where(valid, codes, NOT_LISTED), zeroed & valid, valid)
                per_layer.append([(None, c, z)])
            for merged, struct in _merge_layers(per_layer):
                _, c, z = struct[0]
                out.append(Row(f"{who} {spec.name} L{_ranges([layers.start + i for i in merged])} {sec.name} slot "
                               f"{slot_id} ({tokens} tok, {n} ch)", g, "state", rank, c, z))
    return out

