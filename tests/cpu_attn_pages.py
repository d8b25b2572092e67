"""Run under the vLLM venv (tests/test_cpu_attn.py): CPU_ATTN pages written by vLLM's own kernel,
moved by kvgeom's plan, compared with the pages vLLM's kernel writes on D.

For every pair of block sizes (32, 64, 96) on P and D (P TP1, D TP1 and TP2): both sides'
caches are allocated as vLLM's CPU backend allocates them (``[num_blocks, heads, bs, 2 *
head_dim]`` float32 per layer) and viewed as vLLM views them (``(blocks, heads, 2 * bs, hd)``
chunked into K and V). P's cache is filled by ``ops.cpu_attn_reshape_and_cache`` with known K/V
values at P's slots; kvgeom plans the request (its engine from ``layout="CPU_ATTN"``) and the
copy and zero rows are applied to the raw bytes; the expected D cache is vLLM's kernel writing
the same K/V at D's slots. Equal bytes mean kvgeom put every K and V row where vLLM's own
kernel puts it. A control plans with the naive belief (K rows in token order, what vLLM's
NixlConnector assumes) and must differ wherever the two block sizes tile K differently. The packed
plan (``packed_equal``: pack steps through P's per-plane mapping, wire rows, unpack steps through
D's, in several chunks) is applied the same way and must give the same bytes.

Prints one JSON line: ``{"cells": [{"p": 32, "d": 64, "d_tp": 1, "equal": true, "naive_equal":
false, "copies": ...}, ...], "isa": "vec"}``.
"""

from __future__ import annotations

import json
import sys

import attrs
import numpy as np
import torch
from vllm import _custom_ops as ops

from kvgeom import AttentionSpec, EngineGeometry, ModelSpec, Pair, PlaneLayout, PlanesLayout
from kvgeom.planning.transfer import plan_reference
from kvgeom.values.layout import AttentionGroupGeometry
from kvgeom.values.request import BlockList, GroupRequest, Request

HEADS, LAYERS, TOKENS, NUM_BLOCKS = 4, 2, 150, 12
DTYPES = {"vec": (torch.float32, 4), "amx": (torch.bfloat16, 2)}  # the kernel vLLM picks per dtype here


def kv_values(layer: int, hd: int, isa: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Distinct K and V values per (layer, token, head, element); bf16 caches get distinct bit patterns."""
    t = torch.arange(TOKENS)[:, None, None]
    h = torch.arange(HEADS)[None, :, None]
    d = torch.arange(hd)[None, None, :]
    if isa == "amx":  # 15-bit ids as raw bf16 bits (the kernel copies them; no arithmetic on the values)
        ids = ((layer * TOKENS + t) * HEADS + h) * hd + d
        key = (ids % 16384 + 1).to(torch.int16).contiguous().view(torch.bfloat16)
        return key, (key.view(torch.int16) + 16384).contiguous().view(torch.bfloat16)
    key = (1 + layer * 1e6 + t * 1000 + h * 100 + d).to(torch.float32).contiguous()
    return key, (-key).contiguous()


def caches(bs: int, heads: int, hd: int, isa: str) -> list[torch.Tensor]:
    return [torch.zeros(NUM_BLOCKS, heads, bs, 2 * hd, dtype=DTYPES[isa][0]) for _ in range(LAYERS)]


def vllm_write(cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor, ids: list[int], isa: str) -> None:
    """vLLM's own write: the cache viewed and chunked as CPU_ATTN does, slots from the block table."""
    nb, h, bs, _ = cache.size()
    kv = cache.view((nb, h, bs * 2, -1))
    key_cache, value_cache = kv.chunk(2, dim=2)
    tok = torch.arange(key.shape[0])
    slots = (torch.tensor(ids)[tok // bs] * bs + tok % bs).to(torch.int64)
    ops.cpu_attn_reshape_and_cache(key, value, key_cache, value_cache, slots, isa)


def belief(e: EngineGeometry, bs: int, hd: int, eb: int, which: str) -> EngineGeometry:
    """The same engine under a wrong belief about K: ``rows`` (K rows in token order, contiguous:
    what vLLM's NixlConnector regroups by) or ``tiled32`` (token 32 j + i in K row i t + j)."""
    row = hd * eb
    t = bs // 32
    k_modes = ((bs, row),) if which == "rows" or t == 1 else ((32, t * row), (t, row))
    lay = PlanesLayout((PlaneLayout(0, 2 * bs * row, k_modes), PlaneLayout(bs * row, 2 * bs * row, ((bs, row),))))
    g = e.groups[0]
    assert isinstance(g, AttentionGroupGeometry)
    return EngineGeometry(model=e.model, tp=e.tp, kernel_block_tokens=e.kernel_block_tokens,
                          blocks_per_logical=1, regions=e.regions, groups=(AttentionGroupGeometry(lay, g.views),),
                          name=e.name)


def apply(plan, p_mem: list[list[np.ndarray]], d_mem: list[list[np.ndarray]]) -> None:  # type: ignore[no-untyped-def]
    c = plan.copies
    for i in range(len(c)):
        n = int(c.nbytes[i])
        src = p_mem[int(c.p_rank[i])][int(c.p_region[i])]
        dst = d_mem[int(c.d_rank[i])][int(c.d_region[i])]
        dst[int(c.d_offset[i]):int(c.d_offset[i]) + n] = src[int(c.p_offset[i]):int(c.p_offset[i]) + n]
    z = plan.zeros
    for i in range(len(z)):
        dst = d_mem[int(z.d_rank[i])][int(z.d_region[i])]
        dst[int(z.d_offset[i]):int(z.d_offset[i]) + int(z.nbytes[i])] = 0


def apply_packed(plan, p_mem: list[list[np.ndarray]], d_mem: list[list[np.ndarray]]) -> None:  # type: ignore[no-untyped-def]
    """A packed plan chunk by chunk on the raw bytes (docs/design.md §12.1): packs into each P rank's
    slot, wire rows into each D rank's slot, unpacks into D's pages; then the zeros."""
    for c in range(len(plan.chunks)):
        slots = {side: {r: np.zeros(max(1, int(plan.staging_used(side)[c, r])), np.uint8)
                        for r in range(plan.staging_used(side).shape[1])} for side in ("prefill", "decode")}
        for steps, mem in ((plan.packs, p_mem), (plan.unpacks, d_mem)):
            for st in steps:
                if st.chunk != c:
                    continue
                u = np.arange(st.unit_bytes)
                slot = slots[st.side][st.rank]
                for lam in range(len(st.regions)):
                    cache = (st.cache_offsets(lam)[..., None] + u).ravel()
                    staged = (st.staging_offsets(lam)[..., None] + u).ravel()
                    region = mem[st.rank][int(st.regions[lam])]
                    if st.side == "prefill":
                        slot[staged] = region[cache]
                    else:
                        region[cache] = slot[staged]
            if steps is plan.packs:
                w = plan.wire
                for i in np.flatnonzero(w.chunk == c):
                    n, po, do = int(w.nbytes[i]), int(w.p_offset[i]), int(w.d_offset[i])
                    slots["decode"][int(w.d_rank[i])][do:do + n] = slots["prefill"][int(w.p_rank[i])][po:po + n]
    apply(attrs.evolve(plan, copies=type(plan.copies).empty()), p_mem, d_mem)  # the zeros


def raw(t: torch.Tensor) -> np.ndarray:
    return t.view(torch.uint8).numpy().reshape(-1)


def k_place(cache: torch.Tensor, key: torch.Tensor, block: int, head: int, token: int) -> list[int]:
    """Element offsets, inside (block, head)'s K half, of ``token``'s K elements as vLLM's kernel wrote them."""
    nb, h, bs, two_hd = cache.size()
    k = cache.view(nb, h, 2 * bs, two_hd // 2).chunk(2, dim=2)[0][block, head].reshape(-1)
    want = key[token, head]
    bits = (lambda x: x.view(torch.int16)) if cache.dtype == torch.bfloat16 else (lambda x: x)
    kb, wb = bits(k.contiguous()), bits(want.contiguous())
    return [int(torch.nonzero(kb == w)[0]) for w in wb[:3]]


def cell(bp: int, bd: int, d_tp: int, isa: str, hd: int) -> dict[str, object]:
    dtype, eb = DTYPES[isa]
    model = ModelSpec("tiny", (AttentionSpec("attn", "full", LAYERS, HEADS, hd * eb),),
                      dtype="float32" if eb == 4 else "bfloat16")
    P = EngineGeometry.build(model, tp=1, kernel_block_tokens=bp, num_blocks=NUM_BLOCKS, layout="CPU_ATTN",
                             cpu_isa=isa, name="P")
    D = EngineGeometry.build(model, tp=d_tp, kernel_block_tokens=bd, num_blocks=NUM_BLOCKS, layout="CPU_ATTN",
                             cpu_isa=isa, name="D")
    p_ids = [9, 2, 7, 0, 5, 11][: -(-TOKENS // bp)]
    d_ids = [4, 10, 1, 8, 3, 6][: -(-TOKENS // bd)]
    request = Request(TOKENS, (GroupRequest(BlockList(p_ids), BlockList(d_ids)),))
    vals = [kv_values(layer, hd, isa) for layer in range(LAYERS)]
    p_cache = caches(bp, HEADS, hd, isa)
    for layer in range(LAYERS):
        vllm_write(p_cache[layer], *vals[layer], p_ids, isa)
    hh = HEADS // d_tp
    expected = [caches(bd, hh, hd, isa) for _ in range(d_tp)]
    for r in range(d_tp):
        for layer in range(LAYERS):
            k, v = vals[layer]
            vllm_write(expected[r][layer], k[:, r * hh:(r + 1) * hh].contiguous(),
                       v[:, r * hh:(r + 1) * hh].contiguous(), d_ids, isa)
    out: dict[str, object] = {"p": bp, "d": bd, "d_tp": d_tp, "isa": isa, "hd": hd,
                              # where vLLM's kernel put K of token 37, head 1 (first 3 elements) on each side
                              "k37_p": k_place(p_cache[0], vals[0][0], p_ids[37 // bp], 1, 37),
                              "k37_d": k_place(expected[0][0], vals[0][0][:, :hh], d_ids[37 // bd], 1, 37)}
    engines = {"equal": (P, D)}
    for which in ("rows", "tiled32"):
        engines[f"{which}_equal"] = (belief(P, bp, hd, eb, which), belief(D, bd, hd, eb, which))
    engines["packed_equal"] = (P, D)
    engines["packed_rows_equal"] = engines["rows_equal"]  # the control of the packed plan
    for label, (pe, de) in engines.items():
        pair = Pair(pe, de)
        packed = label.startswith("packed")  # the packed plan (docs/design.md §12), in chunks of ~40 tokens
        plan = plan_reference(pair, request, strategy="packed" if packed else "direct", budget=None,
                              staging_bytes=40 * 2 * HEADS * hd * eb if packed else 0)
        got = [caches(bd, hh, hd, isa) for _ in range(d_tp)]
        for r in range(d_tp):  # stale bytes D's zero rows must clear
            for t in got[r]:
                raw(t)[:] = 0x5A
        (apply_packed if packed else apply)(plan, [[raw(t) for t in p_cache]],
                                            [[raw(t) for t in got[r]] for r in range(d_tp)])
        # the blocks D lists, bytewise (unlisted blocks are never written)
        out[label] = all(bool(np.array_equal(raw(got[r][layer][d_ids].contiguous()),
                                             raw(expected[r][layer][d_ids].contiguous())))
                         for r in range(d_tp) for layer in range(LAYERS))
        if label == "equal":
            out["copies"] = len(plan.copies)
            out["zeros"] = len(plan.zeros)
        if label == "packed_equal":
            out["packed_chunks"] = len(plan.chunks)
    return out


def main() -> None:
    sizes = [int(x) for x in sys.argv[1:]] or [32, 64, 96]
    cells = [cell(bp, bd, d_tp, "vec", 64) for bp in sizes for bd in sizes for d_tp in (1, 2)]
    cells += [cell(32, 64, 1, "vec", 32), cell(64, 32, 1, "vec", 32)]  # head_dim 32: a K "row" is 32 tokens
    cells += [cell(bp, bd, 1, "amx", 64) for bp in sizes for bd in sizes if bp != bd]
    print(json.dumps({"cells": cells}))


if __name__ == "__main__":
    main()
