"""engine_from_vllm_config: vLLM KV-cache configs written out as plain data, read into geometries.

Each config below is what a vLLM worker of that model and TP size holds (``KVCacheConfig`` with
``num_blocks``, ``kv_cache_tensors`` and ``kv_cache_groups``, per-rank spec fields in vLLM's names
and units), written here by hand from the public model configs. Where a preset describes the same
engine, the geometry read from the config must equal the preset's; otherwise the test checks the
numbers against arithmetic done here.
"""

from __future__ import annotations

from typing import Any

import pytest

from kvgeom import EngineGeometry, GeometryError, Pair, fresh_request, pairable, plan_transfer
from kvgeom.building import engine_from_vllm_config, get_preset
from kvgeom.values import AttentionGroupGeometry, PageLayout, Region, StateGroupGeometry, StateLayout


def attn_spec(block: int, heads: int, head_size: int = 128, **kw: Any) -> dict[str, Any]:
    return {"type": "FullAttentionSpec", "block_size": block, "num_kv_heads": heads, "head_size": head_size,
            "dtype": "torch.bfloat16", **kw}


def config(num_blocks: int, groups: list[tuple[dict[str, Any], list[str]]], page: int) -> dict[str, Any]:
    """vLLM's general case: tensor i is shared by layer i of every group, ``page * num_blocks`` bytes."""
    depth = max(len(names) for _, names in groups)
    tensors = [{"size": page * num_blocks, "shared_by": [names[i] for _, names in groups if i < len(names)]}
               for i in range(depth)]
    return {"num_blocks": num_blocks, "kv_cache_tensors": tensors,
            "kv_cache_groups": [{"layer_names": names, "kv_cache_spec": spec} for spec, names in groups]}


def same(a: EngineGeometry, b: EngineGeometry) -> None:
    assert a.model == b.model and a.tp == b.tp and a.kernel_block_tokens == b.kernel_block_tokens
    assert a.blocks_per_logical == b.blocks_per_logical and a.regions == b.regions and a.groups == b.groups


# ---- Llama-3-8B: 32 layers, 8 KV heads of 128 bf16 ------------------------------------------------------

LLAMA_LAYERS = [f"model.layers.{i}.self_attn.attn" for i in range(32)]


def test_llama3_8b_tp2_flash_attention_nhd_is_the_preset_prefill() -> None:
    page = 2 * 16 * 4 * 128 * 2  # vLLM page_size_bytes: K and V, 16 tokens, 4 heads per rank, 128 x bf16 = 32768
    cfg = config(9, [(attn_spec(16, 4), LLAMA_LAYERS)], page)
    geo = engine_from_vllm_config(cfg, tp=2, attention_backend="FLASH_ATTN", kv_cache_layout="NHD",
                                  group_names=["attn"], model_name="llama-3-8b-like", name="prefill")
    assert geo.regions == (Region(9, page // 2),) * 64  # FLASH_ATTN (2, blocks, ...): K half and V half per layer
    assert geo.groups[0].layout == PageLayout(kv_stride=0, head_stride=256, token_stride=4 * 256)  # type: ignore[union-attr]
    same(geo, get_preset("gqa-tp2-tp4").factory(9, 14, 32)[0])


def test_llama3_8b_tp4_flashinfer_hnd_8_token_pages_is_the_preset_decode() -> None:
    page = 2 * 8 * 2 * 128 * 2  # 8192
    cfg = config(14, [(attn_spec(8, 2), LLAMA_LAYERS)], page)
    geo = engine_from_vllm_config(cfg, tp=4, attention_backend="FLASHINFER", kv_cache_layout="HND",
                                  group_names=["attn"], model_name="llama-3-8b-like", name="decode")
    assert geo.regions == (Region(14, page),) * 32
    assert geo.groups[0].layout == PageLayout(kv_stride=2 * 8 * 256, head_stride=8 * 256, token_stride=256)  # type: ignore[union-attr]
    same(geo, get_preset("gqa-tp2-tp4").factory(9, 14, 32)[1])


def test_llama3_8b_tp4_with_a_256_token_block_on_16_token_kernel_pages() -> None:
    """--block-size 256 with a backend whose kernel page is 16: ppl = 256 / 16 = 16 kernel pages per block."""
    page = 2 * 256 * 2 * 128 * 2
    geo = engine_from_vllm_config(config(3, [(attn_spec(256, 2), LLAMA_LAYERS)], page), tp=4,
                                  attention_backend="FLASHINFER", kv_cache_layout="HND", kernel_block_size=16)
    assert (geo.kernel_block_tokens, geo.blocks_per_logical) == (16, 16)
    assert geo.regions[0] == Region(3 * 16, page // 16)


# ---- DeepSeek-V3: 61 MLA layers, latent 512 + rope 64 = 576 bf16 -----------------------------------------

@pytest.mark.parametrize("tp, side", [(8, 0), (1, 1)])
def test_deepseek_v3_flashmla_is_the_preset(tp: int, side: int) -> None:
    spec = {"type": "MLAAttentionSpec", "block_size": 64, "num_kv_heads": 1, "head_size": 576,
            "dtype": "torch.bfloat16", "cache_dtype_str": "auto"}
    layers = [f"model.layers.{i}.self_attn.attn" for i in range(61)]
    page = 64 * 576 * 2  # 73728: MLA pages hold the latent once per token
    geo = engine_from_vllm_config(config(6, [(spec, layers)], page), tp=tp, attention_backend="FLASHMLA",
                                  group_names=["mla"], model_name="deepseek-v3-like")
    assert geo.regions == (Region(6, page),) * 61 and geo.groups[0].layout.token_stride == 1152  # type: ignore[union-attr]
    same(geo, get_preset("deepseek-v3-tp8-tp1").factory(6, 6, 61)[side])


# ---- Qwen3-Next: gated attention (2 KV heads of 256) + Gated DeltaNet -------------------------------------

def qwen3_next_gdn(tp: int, block: int, page: int) -> dict[str, Any]:
    """GDN: 16 key heads and 32 value heads of 128, conv kernel 4: conv dim 128*16*2 + 128*32 = 8192."""
    return {"type": "MambaSpec", "block_size": block, "shapes": [[8192 // tp, 3], [32 // tp, 128, 128]],
            "dtypes": ["torch.bfloat16", "torch.float32"], "page_size_padded": page, "mamba_type": "gdn_attention",
            "mamba_cache_mode": "none"}


@pytest.mark.parametrize("tp, ppl, side", [(2, 66, 0), (4, 33, 1)])
def test_qwen3_next_hybrid_is_the_preset(tp: int, ppl: int, side: int) -> None:
    # attention page per 16-token kernel page: 2 planes x 1 head per rank x 16 x 512 B = 16384;
    # state per rank: conv 8192/tp x 3 x 2 B + recurrent 32/tp heads x 128 x 128 x 4 B
    state = 8192 // tp * 3 * 2 + 32 // tp * 128 * 128 * 4
    assert ppl == -(-state // 16384)  # vLLM's hybrid block: 66 pages (TP2), 33 (TP4)
    block, page = ppl * 16, ppl * 16384
    cfg = config(3, [(attn_spec(block, 1, 256), ["model.layers.3.self_attn.attn", "model.layers.7.self_attn.attn"]),
                     (qwen3_next_gdn(tp, block, page), ["model.layers.0.linear_attn", "model.layers.1.linear_attn"])],
                 page)
    geo = engine_from_vllm_config(cfg, tp=tp, attention_backend="FLASH_ATTN", kv_cache_layout="HND",
                                  kernel_block_size=16, total_num_kv_heads=2, group_names=["attn", "gdn"],
                                  model_name="qwen3-next-like")
    assert geo.regions == (Region(3 * ppl, 16384),) * 2  # hybrid: FLASH_ATTN is blocks-first, one region per slot
    same(geo, get_preset("qwen3-next-tp2-tp4").factory(3, 3, 2)[side])


def test_qwen3_next_80b_full_depth_groups_and_transfer() -> None:
    """48 layers, 12 full attention (every 4th) and 36 GDN: vLLM makes 4 groups of 12 layers (attention and
    three GDN groups, layers[i::3]) over 12 tensors, each shared by one layer of every group."""
    attn_layers = [f"model.layers.{i}.self_attn.attn" for i in range(3, 48, 4)]
    gdn_layers = [f"model.layers.{i}.linear_attn" for i in range(48) if i % 4 != 3]
    engines = []
    for tp, ppl in ((2, 66), (4, 33)):
        block, page = ppl * 16, ppl * 16384
        groups = [(attn_spec(block, 1, 256), attn_layers)] + [
            (qwen3_next_gdn(tp, block, page), gdn_layers[j::3]) for j in range(3)]
        geo = engine_from_vllm_config(config(8, groups, page), tp=tp, attention_backend="FLASH_ATTN",
                                      kv_cache_layout="HND", kernel_block_size=16, total_num_kv_heads=2,
                                      name=f"tp{tp}")
        assert [g.name for g in geo.model.groups] == ["full0", "mamba1", "mamba2", "mamba3"]
        assert [g.num_layers for g in geo.model.groups] == [12] * 4 and len(geo.regions) == 12
        assert geo.regions[5] == Region(8 * ppl, 16384)
        for g in geo.groups:  # layer i of every group lives in region i (vLLM's overlay)
            regions = [v.regions[0] if isinstance(g, AttentionGroupGeometry) else v.region for v in g.views]
            assert regions == list(range(12))
        engines.append(geo)
    P, D = engines
    assert pairable(P, D)
    request = fresh_request(Pair(P, D), 1000, decode_tokens=1001)  # N - 1 rule: P computes M = N - 1 tokens
    plan = plan_transfer(P, D, request)
    assert sorted(set(plan.copies.p_rank.tolist())) == [0, 1] and sorted(set(plan.copies.d_rank.tolist())) == [0, 1, 2, 3]


# ---- Nemotron-H-8B: Mamba2 (conv x/B/C + ssm) + GQA attention --------------------------------------------

def nemotron_mamba(tp: int, block: int, page: int, conv_layout: str = "DS") -> dict[str, Any]:
    """Mamba2: 128 heads of 64, state 128, 8 groups, conv kernel 4: conv dim 8192 + 2 x 8 x 128 = 10240."""
    conv = [10240 // tp, 3] if conv_layout == "DS" else [3, 10240 // tp]
    return {"type": "MambaSpec", "block_size": block, "shapes": [conv, [128 // tp, 64, 128]],
            "dtypes": ["torch.bfloat16", "torch.float32"], "page_size_padded": page, "mamba_type": "mamba2"}


@pytest.mark.parametrize("tp, side", [(1, 0), (4, 1)])
def test_nemotron_h_hybrid_is_the_preset(tp: int, side: int) -> None:
    # docs/design.md §3.2: the TP1 state is 4,255,744 B and a 16-token attention page 65,536 B: ppl 65
    ppl = 65
    kernel_page = 2 * (8 // tp) * 16 * 256
    block, page = ppl * 16, ppl * kernel_page
    cfg = config(2, [(attn_spec(block, 8 // tp), ["model.layers.4.mixer.attn", "model.layers.11.mixer.attn"]),
                     (nemotron_mamba(tp, block, page), ["model.layers.0.mixer", "model.layers.2.mixer"])], page)
    geo = engine_from_vllm_config(cfg, tp=tp, attention_backend="FLASH_ATTN", kv_cache_layout="HND",
                                  kernel_block_size=16, group_names=["attn", "mamba"], model_name="nemotron-h-8b-like")
    state = geo.model.groups[1]
    assert [(s.name, s.channels) for s in state.sections] == [("x", 8192), ("B", 1024), ("C", 1024), ("ssm", 128)]  # type: ignore[union-attr]
    same(geo, get_preset("nemotron-h-tp1-tp4").factory(2, 2, 2)[side])


def test_sd_conv_layout_is_state_major() -> None:
    block, page = 65 * 16, 65 * 65536
    cfg = config(2, [(attn_spec(block, 8), ["a.0"]), (nemotron_mamba(1, block, page, "SD"), ["m.0"])], page)
    geo = engine_from_vllm_config(cfg, tp=1, attention_backend="FLASHINFER", kv_cache_layout="HND",
                                  kernel_block_size=16, conv_state_layout="SD")
    g = geo.groups[1]
    assert isinstance(g, StateGroupGeometry) and g.layout is StateLayout.STATE_MAJOR
    # SD: (kernel - 1, conv dim): row w of every channel together, so x, B and C share rows of 10240 x 2 B
    assert geo.state_sections(1)[1].offset == 8192 * 2 and geo.state_sections(1)[0].row_stride == 10240 * 2


# ---- what is refused ---------------------------------------------------------------------------------

def test_refusals_name_the_field() -> None:
    page = 2 * 16 * 4 * 128 * 2
    good = config(9, [(attn_spec(16, 4), LLAMA_LAYERS[:2])], page)
    cases: list[tuple[dict[str, Any], dict[str, Any], str]] = [
        (good, {"attention_backend": "XFORMERS"}, "attention_backend"),
        ({**good, "num_blocks": 0}, {}, "kv_cache_config.num_blocks"),
        (config(9, [(attn_spec(16, 4, dtype="torch.float64"), LLAMA_LAYERS[:2])], page), {},
         "kv_cache_config.kv_cache_groups[0].kv_cache_spec.dtype"),
        (config(9, [({**attn_spec(16, 4), "type": "CrossAttentionSpec"}, LLAMA_LAYERS[:2])], page), {},
         "kv_cache_config.kv_cache_groups[0].kv_cache_spec.type"),
        ({**good, "kv_cache_tensors": [{"size": page * 9 + 1, "shared_by": LLAMA_LAYERS[:2]}]}, {},
         "kv_cache_config.kv_cache_tensors[0].size"),
        ({**good, "kv_cache_tensors": [{"size": page * 9, "shared_by": ["nope"]}]}, {},
         "kv_cache_config.kv_cache_tensors[0].shared_by"),
        (good, {"kernel_block_size": 6}, "kernel_block_size"),
        (config(9, [(attn_spec(16, 4, kv_quant_mode="FP8_PER_TOKEN_HEAD"), LLAMA_LAYERS[:2])], page), {},
         "kv_cache_config.kv_cache_groups[0].kv_cache_spec.kv_quant_mode"),
        ({**good, "kv_cache_tensors": [{"size": page * 9, "shared_by": LLAMA_LAYERS[:2], "offset": 0,
                                         "block_stride": 2 * page}]}, {}, "kv_cache_config.kv_cache_tensors[0].block_stride"),
        (good, {"attention_backend": "FLASHMLA"}, "attention_backend"),
    ]
    for cfg, extra, path in cases:
        kw: dict[str, Any] = {"tp": 2, "attention_backend": "FLASH_ATTN", **extra}
        with pytest.raises(GeometryError) as err:
            engine_from_vllm_config(cfg, **kw)
        assert err.value.path == path, (path, str(err.value))


def test_objects_with_attributes_work_like_dicts() -> None:
    """Dataclass-like objects (vLLM's own, or anything with the same attribute names) read the same way."""

    class FullAttentionSpec:
        def __init__(self) -> None:
            self.block_size, self.num_kv_heads, self.head_size, self.dtype = 16, 4, 128, "bfloat16"

    class Obj:
        def __init__(self, **kw: Any) -> None:
            self.__dict__.update(kw)

    page = 2 * 16 * 4 * 128 * 2
    cfg = Obj(num_blocks=9, kv_cache_tensors=[Obj(size=page * 9, shared_by=["l0"])],
              kv_cache_groups=[Obj(layer_names=["l0"], kv_cache_spec=FullAttentionSpec())])
    geo = engine_from_vllm_config(cfg, tp=2, attention_backend="FLASHINFER", kv_cache_layout="HND")
    assert geo.regions == (Region(9, page),)
