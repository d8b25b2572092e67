"""The engine pairs and requests the benchmarks run: presets, synthetic pairs, block allocations.

    case name --> (Pair with block pools sized for M tokens, N = D's tokens, strategy)
    pattern   --> block ids drawn from each side's pool: fresh | fragmented | scattered
    request   --> kvgeom.fresh_request's shape (which groups list how many blocks from which token),
                  with its ids 0..n-1 renamed to the drawn ids (state slots too), so groups that
                  share a region still never share a block

Allocation patterns over a pool of ``B`` logical blocks, ``n`` of them drawn:

    fresh       0, 1, 2, ..., n-1                                      (an empty cache)
    fragmented  the pool cut into runs of random length 1..16, runs shuffled, first n ids
                e.g. [7 8 9] [2] [12 13 14 15] [0 1] ...               (a cache after churn)
    scattered   a random permutation of the pool, first n ids          (the worst case)

Synthetic pairs use a Llama-3-8B-like group (32 layers, 8 KV heads of 256 B) unless noted; the
preset pairs are kvgeom.building.presets' factories with larger pools. Pools hold ``pool_factor`` times
a bound of the blocks the request needs (plus 16), so fragmented and scattered draws really are spread out.

Worked number: ``syn-tp1-tp1`` at M = 1024 lists 1024 / 16 = 64 logical blocks per side; the
pool is sized from the bound 64 + 1 = 65 (a listing may start mid-block), so with pool_factor 2
each pool holds 2 * 65 + 16 = 146 blocks.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import attrs
import numpy as np

from kvgeom import (
    AttentionSpec,
    BlockList,
    EngineGeometry,
    GroupRequest,
    ModelSpec,
    Pair,
    Request,
    StateSlots,
    StateSpec,
    fresh_request,
)
from kvgeom.building import get_preset
from kvgeom.planning import Strategy

__all__ = ["Case", "SYNTHETIC", "PATTERNS", "build_case", "draw_blocks", "pattern_request", "case_names"]

PATTERNS: tuple[str, ...] = ("fresh", "fragmented", "scattered")
MAX_RUN_BLOCKS = 16


@attrs.frozen
class Case:
    """A benchmark pair: the engines, D's token count N for M computed tokens, the strategy."""

    name: str
    pair: Pair = attrs.field(repr=False)
    tokens: int
    decode_tokens: int
    strategy: Strategy = "direct"

    def fresh(self) -> Request:
        return fresh_request(self.pair, self.tokens, decode_tokens=self.decode_tokens)


@attrs.frozen
class Synthetic:
    """A synthetic pair: model shape, each side's EngineGeometry.build keywords, strategy."""

    description: str
    p: dict[str, Any]
    d: dict[str, Any]
    layers: int = 32
    heads: int = 8
    head_bytes: int = 256
    strategy: Strategy = "direct"
    dtype: str = "bfloat16"

    def model(self, layers: int | None = None) -> ModelSpec:
        n = self.layers if layers is None else layers
        return ModelSpec("llama-3-8b-like", (AttentionSpec("attn", "full", n, self.heads, self.head_bytes),),
                         dtype=self.dtype)


SYNTHETIC: dict[str, Synthetic] = {
    "syn-tp1-tp1": Synthetic("TP1 -> TP1, HND 16-token pages, K/V packed on both sides",
                             {"tp": 1, "kernel_block_tokens": 16}, {"tp": 1, "kernel_block_tokens": 16}),
    "syn-tp1-tp1-inner": Synthetic("TP1 -> TP1, HND 16-token pages, K/V inner (vLLM's [H, N, 2*D] content dim)",
                                   {"tp": 1, "kernel_block_tokens": 16, "kv": "inner"},
                                   {"tp": 1, "kernel_block_tokens": 16, "kv": "inner"}),
    "syn-tp2-tp4-inner": Synthetic("TP2 -> TP4, HND 16-token pages, K/V inner",
                                   {"tp": 2, "kernel_block_tokens": 16, "kv": "inner"},
                                   {"tp": 4, "kernel_block_tokens": 16, "kv": "inner"}),
    "syn-tp4-tp1": Synthetic("TP4 -> TP1, HND 16-token pages, K/V packed (D reads 4 P ranks per page)",
                             {"tp": 4, "kernel_block_tokens": 16}, {"tp": 1, "kernel_block_tokens": 16}),
    "syn-tp2-tp1": Synthetic("TP2 -> TP1, HND 16-token pages, K/V packed (D reads 2 P ranks per page)",
                             {"tp": 2, "kernel_block_tokens": 16}, {"tp": 1, "kernel_block_tokens": 16}),
    "syn-tp2-tp4-k16-k32": Synthetic("TP2 16-token pages -> TP4 32-token pages, HND, K/V packed",
                                     {"tp": 2, "kernel_block_tokens": 16}, {"tp": 4, "kernel_block_tokens": 32}),
    "syn-nhd-tp2-hnd-tp4": Synthetic("Llama-3-70B-like (8 KV heads x 256 B): TP2 NHD -> TP4 HND, 16-token pages, "
                                     "K/V packed", {"tp": 2, "kernel_block_tokens": 16, "layout": "NHD"},
                                     {"tp": 4, "kernel_block_tokens": 16}, layers=80),
    "syn-nhd-hnd-staged": Synthetic("TP1 NHD -> TP1 HND, 16-token pages, K/V packed, strategy staged",
                                    {"tp": 1, "kernel_block_tokens": 16, "layout": "NHD"},
                                    {"tp": 1, "kernel_block_tokens": 16}, strategy="staged"),
    "syn-cpu-attn-k32-k64": Synthetic("vLLM CPU_ATTN pages (per plane, K transposed; docs/design.md §3.5), "
                                      "128 float32 elements per head: TP1 32-token blocks -> TP1 64-token blocks",
                                      {"tp": 1, "kernel_block_tokens": 32, "layout": "CPU_ATTN"},
                                      {"tp": 1, "kernel_block_tokens": 64, "layout": "CPU_ATTN"},
                                      head_bytes=512, strategy="packed", dtype="float32"),
}


def case_names() -> list[str]:
    """Every name :func:`build_case` accepts: synthetic pairs and the pairable presets."""
    from kvgeom.building import PRESETS

    return sorted(SYNTHETIC) + sorted(n for n, p in PRESETS.items() if p.pairable)


def _needed_blocks(engine: EngineGeometry, lo: int, hi: int) -> int:
    """An upper bound of the logical blocks fresh_request lists on ``engine`` for tokens [lo, hi)."""
    B = engine.logical_block_tokens
    total = 0
    for spec in engine.model.groups:
        total += 1 if isinstance(spec, StateSpec) else -(-(hi - lo // B * B) // B) + 1
    return total


def build_case(name: str, tokens: int, *, pool_factor: float = 1.0, layers: int | None = None) -> Case:
    """The pair ``name`` with pools of ``pool_factor`` x the blocks an M = ``tokens`` request needs."""
    if name in SYNTHETIC:
        syn = SYNTHETIC[name]
        factory: Callable[[int, int, int], tuple[EngineGeometry, EngineGeometry]]

        def factory(pb: int, db: int, n_layers: int) -> tuple[EngineGeometry, EngineGeometry]:
            m = syn.model(n_layers)
            return (EngineGeometry.build(m, num_blocks=pb, name="prefill", **syn.p),
                    EngineGeometry.build(m, num_blocks=db, name="decode", **syn.d))

        n_layers = syn.layers if layers is None else layers
        decode_tokens, strategy = tokens, syn.strategy
    else:
        preset = get_preset(name)
        factory = preset.factory
        n_layers = preset.default_layers if layers is None else layers
        decode_tokens, strategy = preset.decode_tokens(tokens), "direct"
    small_p, small_d = factory(1, 1, n_layers)
    p_blocks = int(pool_factor * _needed_blocks(small_p, 0, tokens)) + 16
    d_blocks = int(pool_factor * _needed_blocks(small_d, 0, decode_tokens)) + 16
    prefill, decode = factory(p_blocks, d_blocks, n_layers)
    return Case(name, Pair(prefill, decode), tokens, decode_tokens, strategy)


def draw_blocks(pattern: str, pool: int, n: int, rng: np.random.Generator) -> np.ndarray:
    """``n`` distinct logical block ids from a pool of ``pool`` blocks (see the module docstring)."""
    if n > pool:
        raise ValueError(f"cannot draw {n} blocks from a pool of {pool}")
    if pattern == "fresh":
        return np.arange(n, dtype=np.int64)
    if pattern == "scattered":
        return rng.permutation(pool)[:n].astype(np.int64)
    if pattern == "fragmented":
        lengths = []
        left = pool
        while left > 0:
            k = min(left, int(rng.integers(1, MAX_RUN_BLOCKS + 1)))
            lengths.append(k)
            left -= k
        starts = np.cumsum([0] + lengths[:-1])
        runs = [np.arange(s, s + k, dtype=np.int64) for s, k in zip(starts, lengths)]
        order = rng.permutation(len(runs))
        return np.concatenate([runs[i] for i in order])[:n]
    raise ValueError(f"unknown allocation pattern {pattern!r}; use one of {', '.join(PATTERNS)}")


def _pool(engine: EngineGeometry) -> int:
    return min(engine.num_logical_blocks(r) for r in range(len(engine.regions)))


def pattern_request(case: Case, pattern: str, rng: np.random.Generator) -> Request:
    """``case``'s fresh request with each side's ids renamed to ids drawn by ``pattern``."""
    template = fresh_request(case.pair, case.tokens, decode_tokens=case.decode_tokens)
    drawn: dict[str, np.ndarray] = {}
    for side in ("prefill", "decode"):
        used = 0
        for g in template.groups:
            listing = getattr(g, side)
            ids = listing.block_ids if isinstance(listing, BlockList) else listing.slot_ids
            used = max([used] + [b + 1 for b in ids])
        drawn[side] = draw_blocks(pattern, _pool(case.pair.side(side)), used, rng)
    groups = []
    for g in template.groups:
        sides: dict[str, Any] = {}
        for side in ("prefill", "decode"):
            listing = getattr(g, side)
            ids = drawn[side]
            if isinstance(listing, BlockList):
                sides[side] = BlockList(tuple(int(ids[b]) for b in listing.block_ids), listing.first_token)
            else:
                sides[side] = StateSlots(tuple(int(ids[b]) for b in listing.slot_ids), listing.tokens)
        groups.append(GroupRequest(sides["prefill"], sides["decode"]))
    return Request(template.computed_tokens, tuple(groups), template.prefix_hit_tokens)
