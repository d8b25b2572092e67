"""The attention planner's sweep: many geometry pairs x every prompt length x every strategy,
each plan checked byte by byte by the reference simulator (zero violations)."""

from __future__ import annotations

from typing import Any

import attrs
import numpy as np
import pytest

from kvgeom import (
    AttentionSpec,
    BlockList,
    EngineGeometry,
    GroupRequest,
    ModelSpec,
    Pair,
    Request,
    fresh_request,
    simulate,
)


@attrs.frozen
class Case:
    name: str
    model: ModelSpec
    p: dict[str, Any]
    d: dict[str, Any]
    lengths: tuple[int, ...]


def gqa(heads: int, layers: int = 2, head_bytes: int = 8) -> ModelSpec:
    return ModelSpec(f"gqa{heads}", [AttentionSpec("attn", "full", layers, heads, head_bytes)])


def mla(layers: int = 2, head_bytes: int = 12) -> ModelSpec:
    return ModelSpec("mla", [AttentionSpec("mla", "mla", layers, 1, head_bytes)])


def swa() -> ModelSpec:
    return ModelSpec("swa", [AttentionSpec("full", "full", 1, 4, 8),
                             AttentionSpec("win", "sliding", 1, 4, 8, window_tokens=20)])


def kv(tp: int, K: int, ppl: int = 1, **kw: Any) -> dict[str, Any]:
    return dict(tp=tp, kernel_block_tokens=K, blocks_per_logical=ppl, **kw)


R = tuple(range(1, 50))
T = tuple(range(1, 26))  # TP cases: every length across 3-6 block boundaries (8 ranks x 2 listings each)
CASES = [
    # the vLLM harness pairs (D logical/kernel vs P logical/kernel), pure attention and MLA
    Case("harness D12/4 P8/4 gqa", gqa(4), kv(2, 4, 2), kv(2, 4, 3), R),
    Case("harness D36/4 P8/4 mla", mla(), kv(1, 4, 2), kv(1, 4, 9), tuple(range(1, 80, 3))),
    Case("harness D24/4 P4/4 gqa", gqa(2), kv(1, 4, 1), kv(1, 4, 6), R),
    Case("harness D16/4 P24/4 mla", mla(), kv(1, 4, 6), kv(1, 4, 4), R),
    # kernel pages differing both ways, non powers of two
    Case("kernel P16 D8", gqa(4), kv(1, 16), kv(1, 8), R),
    Case("kernel P8 D16", gqa(4), kv(1, 8), kv(1, 16), R),
    Case("kernel P12 D8", gqa(2), kv(1, 12), kv(1, 8), R),
    Case("kernel P24 D16 ppl", gqa(2), kv(1, 24), kv(1, 16, 2), R),
    # TP pairs, 8 and 2 KV heads (2 heads: replication on the larger side)
    Case("TP1->2 h8", gqa(8), kv(1, 4), kv(2, 4), R),
    Case("TP2->1 h8", gqa(8), kv(2, 4), kv(1, 4), R),
    Case("TP8->1 h8", gqa(8), kv(8, 4), kv(1, 4), T),
    Case("TP1->8 h8", gqa(8), kv(1, 4), kv(8, 4), T),
    Case("TP4->8 h8", gqa(8), kv(4, 4), kv(8, 4, 2), T),
    Case("TP8->1 h2", gqa(2), kv(8, 4), kv(1, 8), T),
    Case("TP1->8 h2", gqa(2), kv(1, 8), kv(8, 4), T),
    Case("TP4->8 h2", gqa(2), kv(4, 4, 2), kv(8, 8), T),
    Case("TP2->4 h2 K12/8", gqa(2), kv(2, 12), kv(4, 8), R),
    # layouts, both ways, and K/V placement
    Case("NHD->HND", gqa(4), kv(2, 8, layout="NHD"), kv(1, 4), R),
    Case("HND->NHD", gqa(4), kv(1, 4), kv(2, 8, layout="NHD"), R),
    Case("split->packed NHD", gqa(4), kv(1, 4, kv="split"), kv(1, 8, layout="NHD"), R),
    Case("inner->split interleaved", gqa(4, layers=3), kv(2, 8, kv="inner"),
         kv(1, 4, kv="split", regions="interleaved"), R),
    Case("interleaved NHD->HND per layer", gqa(2, layers=3), kv(1, 4, layout="NHD", regions="interleaved"),
         kv(2, 8, 2), R),
    # sliding windows with different block sizes on each side
    Case("sliding P8 D12", swa(), kv(1, 8), kv(2, 4, 3), R),
    # KimiLinear-scale MLA: D 5760/64 TP1, P 768/64 TP8 (tiny latents so the caches stay small);
    # blocks are thousands of tokens, so the lengths sit on both sides of each block boundary
    Case("MLA D5760/64 TP1 P768/64 TP8", mla(1, 2), kv(8, 64, 12), kv(1, 64, 90),
         (1, 2, 767, 768, 769, 1535, 1536, 1537, 5759, 5760, 5761, 6528, 6529, 11520, 11521)),
]


def build(case: Case, M: int) -> tuple[Pair, int]:
    lb_p = case.p["kernel_block_tokens"] * case.p["blocks_per_logical"]
    lb_d = case.d["kernel_block_tokens"] * case.d["blocks_per_logical"]
    groups = len(case.model.groups)
    nb_p = groups * (M // lb_p + 3)
    nb_d = groups * (M // lb_d + 3)
    p = EngineGeometry.build(case.model, num_blocks=nb_p, name="prefill", **case.p)
    d = EngineGeometry.build(case.model, num_blocks=nb_d, name="decode", **case.d)
    return Pair(p, d), nb_d


def scattered(req: Request, nb_p: int, nb_d: int, seed: int) -> Request:
    """The same request on shuffled block ids (neighbours in use), positions unchanged."""
    rng = np.random.default_rng(seed)
    perm_p, perm_d = rng.permutation(nb_p), rng.permutation(nb_d)
    out = []
    for g in req.groups:
        assert isinstance(g.prefill, BlockList) and isinstance(g.decode, BlockList)
        out.append(GroupRequest(BlockList(perm_p[list(g.prefill.block_ids)], g.prefill.first_token),
                                BlockList(perm_d[list(g.decode.block_ids)], g.decode.first_token)))
    return Request(req.computed_tokens, out, req.prefix_hit_tokens)


@pytest.mark.parametrize("strategy", ["direct", "staged", "auto"])
@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_sweep_zero_violations(case: Case, strategy: str) -> None:
    for M in case.lengths:
        pair, nb_d = build(case, M)
        nb_p = pair.prefill.num_logical_blocks(0)
        req = fresh_request(pair, M, decode_tokens=M + 1 if M % 3 == 0 else M)
        for r in (req, scattered(req, nb_p, nb_d, M)):
            plan = pair.plan(r, strategy=strategy)
            report = simulate(pair, r, plan, replan=pair.plan(r, strategy=strategy))
            assert report.ok, f"M={M}: {report}"


@pytest.mark.parametrize("case", [c for c in CASES if c.name.startswith(("harness", "TP2->1", "NHD"))],
                         ids=lambda c: c.name)
def test_sweep_with_prefix_hits(case: Case) -> None:
    lb_d = case.d["kernel_block_tokens"] * case.d["blocks_per_logical"]
    for M in case.lengths[::4]:
        for S in range(0, M + 1, lb_d):
            pair, _ = build(case, M)
            req = fresh_request(pair, M, prefix_hit_tokens=S)
            plan = pair.plan(req, strategy="auto")
            report = simulate(pair, req, plan)
            assert report.ok, f"M={M} S={S}: {report}"
