"""vLLM's CPU attention backend (CPU_ATTN) page read from a config: a per-plane layout (docs/design.md §3.5).

vLLM 0.32's ``cpu_attn.py`` views each layer's ``[B, H, N, 2 * hd]`` cache as ``[B, H, 2N, hd]`` and
chunks it: per head, N x hd of K then N x hd of V. The vec kernel (float32 here) stores K transposed,
``[hd][N]``, at every block size; V in token order (measured through vLLM's own writer in
tests/test_cpu_attn.py). The adapter hands the page to :func:`kvgeom.cpu_attn_layout`; the
addresses below are checked by hand.
"""

from __future__ import annotations

from typing import Any

import pytest

from kvgeom import GeometryError, Pair, fresh_request, plan_transfer, simulate
from kvgeom.building import engine_from_vllm_config
from kvgeom.building.vllm_layouts import cpu_attn_layout
from kvgeom.values import Region

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


def test_pages_follow_the_kernels_byte_order() -> None:
    """vec (float32): per head [K: 64 elements x N tokens, transposed][V: N rows x 64 elements] (§3.5)."""
    for block in (32, 64, 96):
        geo = engine_from_vllm_config(cpu_config(block, 2), tp=1, attention_backend="CPU_ATTN")
        head = 2 * block * HB  # a head's K and V: 2 x block x 256 B
        assert geo.regions == (Region(4, 2 * head),) * 2
        for slot in (0, 5, block - 1):
            # head 1, token slot: K element 0 at head + slot * 4 (K is [dim][token]); V row at head + block*HB + slot*HB
            assert int(geo.attention_address(0, 0, 0, 0, slot, 1)[1]) == head + slot * 4
            assert int(geo.attention_address(0, 0, 1, 0, slot, 1)[1]) == head + block * HB + slot * HB


def test_what_is_not_cpu_attn_is_refused() -> None:
    with pytest.raises(GeometryError, match="multiple of 32") as err:
        cpu_attn_layout(heads=2, tokens=16, head_bytes=HB, head_stride=16 * 2 * HB, token_stride=2 * HB,
                        element_bytes=4)
    assert err.value.path == "kernel_block_size"
    # a token-major layout cannot be CPU_ATTN's [2N, hd] rows
    with pytest.raises(GeometryError, match="keep a head's tokens together") as err:
        cpu_attn_layout(heads=2, tokens=32, head_bytes=HB, head_stride=2 * HB, token_stride=2 * 2 * HB,
                        element_bytes=4)
    assert err.value.path == "kv_cache_layout"


@pytest.mark.parametrize(("p_block", "d_block"), [(32, 64), (64, 32), (32, 96), (96, 64)])
def test_different_block_sizes_plan_and_simulate(p_block: int, d_block: int) -> None:
    P = engine_from_vllm_config(cpu_config(p_block, 2, num_blocks=8), tp=1, attention_backend="CPU_ATTN",
                                name="prefill")
    D = engine_from_vllm_config(cpu_config(d_block, 2, num_blocks=8), tp=1, attention_backend="CPU_ATTN",
                                name="decode")
    request = fresh_request(Pair(P, D), 100, decode_tokens=101)
    assert simulate(Pair(P, D), request, plan_transfer(P, D, request)).ok


def test_cpu_attn_tp1_to_tp2_plans_and_simulates() -> None:
    """The geometry the CPU backend gives at block 32 plans like any other: 4 KV heads, TP1 -> TP2."""
    P = engine_from_vllm_config(cpu_config(32, 4, num_blocks=6), tp=1, attention_backend="CPU_ATTN", name="prefill")
    D = engine_from_vllm_config(cpu_config(32, 2, num_blocks=6), tp=2, attention_backend="CPU_ATTN", name="decode")
    request = fresh_request(Pair(P, D), 100, decode_tokens=101)
    assert simulate(Pair(P, D), request, plan_transfer(P, D, request)).ok
