"""vLLM's CPU attention backend (CPU_ATTN) page, kept apart: its K rows are tiled by 32 tokens.

vLLM 0.32's ``cpu_attn.py`` views each layer's ``[B, H, N, 2 * hd]`` cache as ``[B, H, 2N, hd]`` and
chunks it: per head, N K rows then N V rows. Inside a block the K rows are tiled by 32 tokens (token
``32j + i`` in K row ``i * N/32 + j``, V rows plain; docs/design.md §10.2), so at N = 32
the page is plain and at 64 and above K and V have different token orders. kvgeom describes N = 32 and
refuses larger pages until a per-plane token layout (docs/design.md §3) is wired into
``kvgeom.building.vllm_layouts.cpu_attn_layout``: when it is, the refusal test below becomes the
test of the tiled layout.
"""

from __future__ import annotations

from typing import Any

import pytest

from kvgeom import GeometryError, Pair, fresh_request, plan_transfer, simulate
from kvgeom.building import engine_from_vllm_config
from kvgeom.building.vllm_layouts import CPU_ATTN_K_TILE, cpu_attn_layout
from kvgeom.values import PageLayout, Region

HB = 64 * 4  # a head vector: 64 float32


def cpu_config(block: int, heads: int, num_blocks: int = 4, layers: int = 2) -> dict[str, Any]:
    cell = 2 * HB
    page = heads * block * cell
    names = [f"model.layers.{i}.self_attn.attn" for i in range(layers)]
    spec = {"type": "FullAttentionSpec", "block_size": block, "num_kv_heads": heads, "head_size": 64,
            "dtype": "torch.float32"}
    return {"num_blocks": num_blocks, "kv_cache_layout": "LBHNC",
            "kv_cache_tensors": [{"size": layers * num_blocks * page, "layers": names,
                                  "layer_stride": num_blocks * page, "block_stride": page, "offset": 0}],
            "kv_cache_groups": [{"layer_names": names, "kv_cache_spec": spec}]}


def test_32_token_page_is_k_rows_then_v_rows_per_head() -> None:
    # LBHNC: head h at h * 32 * 512; inside it K rows 0..31 (256 B each), then V rows at 32 * 256 = 8192
    lay = cpu_attn_layout(heads=2, tokens=32, head_bytes=HB, head_stride=32 * 2 * HB, token_stride=2 * HB)
    assert lay == PageLayout(kv_stride=32 * HB, head_stride=32 * 2 * HB, token_stride=HB)
    assert (lay.kv_stride, lay.head_stride, lay.token_stride) == (8192, 16384, 256)
    geo = engine_from_vllm_config(cpu_config(32, 2), tp=1, attention_backend="CPU_ATTN")
    assert geo.regions == (Region(4, 2 * 32 * 2 * HB),) * 2 and geo.groups[0].layout == lay  # type: ignore[union-attr]


def test_larger_pages_are_refused_naming_the_tiling() -> None:
    for block in (64, 96, 128):
        with pytest.raises(GeometryError, match="tiled by 32 tokens") as err:
            engine_from_vllm_config(cpu_config(block, 2), tp=1, attention_backend="CPU_ATTN")
        assert err.value.path == "kernel_block_size" and f"i * {block // CPU_ATTN_K_TILE} + j" in str(err.value)
    with pytest.raises(GeometryError, match="multiple of 32") as err:
        cpu_attn_layout(heads=2, tokens=16, head_bytes=HB, head_stride=16 * 2 * HB, token_stride=2 * HB)
    # a token-major layout cannot be CPU_ATTN's [2N, hd] rows
    with pytest.raises(GeometryError, match="keep a head's tokens together") as err:
        cpu_attn_layout(heads=2, tokens=32, head_bytes=HB, head_stride=2 * HB, token_stride=2 * 2 * HB)
    assert err.value.path == "kv_cache_layout"


def test_cpu_attn_tp1_to_tp2_plans_and_simulates() -> None:
    """The geometry the CPU backend gives at block 32 plans like any other: 4 KV heads, TP1 -> TP2."""
    P = engine_from_vllm_config(cpu_config(32, 4, num_blocks=6), tp=1, attention_backend="CPU_ATTN", name="prefill")
    D = engine_from_vllm_config(cpu_config(32, 2, num_blocks=6), tp=2, attention_backend="CPU_ATTN", name="decode")
    request = fresh_request(Pair(P, D), 100, decode_tokens=101)
    assert simulate(Pair(P, D), request, plan_transfer(P, D, request)).ok
