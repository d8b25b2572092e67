"""Descriptor counts: kvgeom's coalesced copies against one descriptor per (region, kernel block).

The per-block count is how vLLM's NIXL connector posts a transfer (docs/design.md §4.3), computed
here from the request and the geometry alone, never from kvgeom's plan::

    attention group, per D rank d:
        sum over the group's layers of (distinct regions of the layer's K/V planes)  -- R
      x streams: 2 when K and V share a region as the page's outermost mode (kvgeom's
                 kv="packed", FlashInfer-style [2, H, N, D]: vLLM posts a K descriptor stream and
                 a V stream); 1 for kv="inner" (vLLM's [H, N, 2*D] content dim) or "split"
      x units: blocks of u = min(K_p, K_d) tokens (vLLM reads at the smaller kernel size,
               bsr > 1 sub-blocks) counted from D's first listed token, that hold a needed token
               in [lo, hi) = [max(S, d0, p0), min(M, d1, p1))
      x sources: P ranks D rank d reads its heads from (kvgeom.arith.shard.sources; MLA reads one)

    state group, per D rank d:
        layers x paired slots (D slots whose token count a P slot has)
      x sum over sections of the P ranks holding D rank d's channels of that section
        (vLLM: one descriptor per conv part and one for the temporal state, per source rank)

kvgeom's count is ``len(plan.copies)`` after coalescing. The ratio kvgeom / per-block is below 1
where runs of consecutive blocks merge into one descriptor (fresh allocations) and near 1 when
nothing is contiguous (scattered).

Worked number: syn-tp1-tp1 (32 layers, HND packed, K = 16) at M = 1024 tokens on fresh blocks:
per-block = 1 D rank x 32 regions x 2 streams x 64 units x 1 source = 4096 descriptors; kvgeom
posts 32 (one per layer region), ratio 32 / 4096 = 0.0078.
"""

from __future__ import annotations

import numpy as np

from kvgeom import (
    AttentionGroupGeometry,
    AttentionSpec,
    BlockList,
    PageLayout,
    Pair,
    Request,
    StateGroupGeometry,
    StateSlots,
    StateSpec,
    sources,
)
from kvgeom.planning import needed_tokens

from .cases import PATTERNS, build_case, pattern_request
from .common import Config, Measurement, Progress, geomean, measurement, quiet

__all__ = ["per_block_descriptors", "run_descriptors"]

POOL_FACTOR = 2.0


def _streams(geo: AttentionGroupGeometry, planes: int) -> int:
    """2 for K/V packed as the page's outermost mode ([2, H, N, D] or [2, N, H, D]) in one region."""
    lay = geo.layout
    if not isinstance(lay, PageLayout):  # per-plane layouts: one stream per page (vLLM's per-block rows)
        return 1
    shared = all(len(set(v.regions)) == 1 for v in geo.views)
    outer = lay.kv_stride > 0 and lay.kv_stride >= max(lay.head_stride, lay.token_stride)
    return planes if planes > 1 and shared and outer else 1


def per_block_descriptors(pair: Pair, request: Request) -> int:
    """Descriptors vLLM's connector would post for ``request`` (formula in the module docstring)."""
    P, D = pair.prefill, pair.decode
    total = 0
    for gi, spec in enumerate(pair.model.groups):
        g = request.groups[gi]
        geo = D.groups[gi]
        if isinstance(spec, AttentionSpec):
            assert isinstance(geo, AttentionGroupGeometry) and isinstance(g.decode, BlockList)  # noqa: S101
            lo, hi = needed_tokens(request, pair, gi)
            if hi <= lo:
                continue
            u = min(P.kernel_block_tokens, D.kernel_block_tokens)
            f = g.decode.first_token
            units = -(-(hi - f) // u) - (lo - f) // u
            regions = sum(len(set(v.regions)) for v in geo.views)
            streams = _streams(geo, spec.planes)
            for d in range(D.tp):
                n_src = len(sources(spec.num_kv_heads, p_tp=P.tp, p_replicated=spec.replicated, d_tp=D.tp,
                                    d_rank=d, d_replicated=spec.replicated))
                total += regions * streams * units * n_src
        else:
            assert isinstance(spec, StateSpec) and isinstance(geo, StateGroupGeometry)  # noqa: S101
            assert isinstance(g.prefill, StateSlots) and isinstance(g.decode, StateSlots)  # noqa: S101
            paired = len(set(g.decode.tokens) & set(g.prefill.tokens))
            for d in range(D.tp):
                per_layer = sum(len(sources(s.channels, p_tp=P.tp, p_replicated=s.replicated, d_tp=D.tp, d_rank=d,
                                            d_replicated=s.replicated)) for s in spec.sections)
                total += len(geo.views) * paired * per_layer
    return total


def run_descriptors(config: Config, progress: Progress = quiet) -> list[Measurement]:
    """kvgeom / per-block descriptor counts for every case and pattern, and a geometric mean per pattern."""
    out: list[Measurement] = []
    ratios: dict[str, list[float]] = {p: [] for p in PATTERNS}
    M = config.desc_tokens
    for name in config.desc_presets + config.desc_synthetic:
        case = build_case(name, M, pool_factor=POOL_FACTOR)
        for pattern in PATTERNS:
            rng = np.random.default_rng(config.seed)
            request = pattern_request(case, pattern, rng)
            progress(f"descriptors {name} {pattern} M={M}")
            plan = case.pair.plan(request, strategy=case.strategy)
            ours, theirs = len(plan.copies), per_block_descriptors(case.pair, request)
            m = measurement("descriptors", f"descriptors/{name}/{pattern}/{M}", ours, "descriptors", theirs,
                            "one descriptor per (region, kernel block, source rank), vLLM-style",
                            note=f"{plan.copies_before_coalescing} before coalescing; strategy {case.strategy}")
            out.append(m)
            ratios[pattern].append(m.ratio)
    for pattern in PATTERNS:
        if ratios[pattern]:
            g = geomean(ratios[pattern])
            out.append(measurement("descriptors", f"descriptors/{pattern}/geomean", g, "x", 1.0,
                                   "equal counts (ratio 1)",
                                   note=f"geometric mean of kvgeom/per-block over {len(ratios[pattern])} pairs"))
    return out
