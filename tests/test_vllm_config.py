"""engine_from_vllm_config: vLLM KV-cache configs written out as plain data, read into geometries.

Each config below is what a vLLM worker of that model and TP size holds (``KVCacheConfig`` with
``num_blocks``, ``kv_cache_tensors`` and ``kv_cache_groups``, per-rank spec fields in vLLM's names
and units), written here by hand from the public model configs. Where a preset describes the same
engine, the geometry read from the config must equal the preset's; otherwise the test checks the
numbers against arithmetic done here.
"""

from __future__ import annotations

import enum
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


# ---- vLLM 0.32's field set: KVCacheTensor(size, layers, layer_stride, block_stride, offset) ---------------

def layered(num_blocks: int, groups: list[tuple[dict[str, Any], list[str]]], page: int, layout: str,
            block_outer: bool = False, **cfg: Any) -> dict[str, Any]:
    """vLLM 0.32's get_kv_cache_config_from_groups: groups alias from byte 0; layer-outer layers one after the
    other (layer_stride = page * num_blocks), block-outer pages side by side in a block row."""
    depth = max(len(names) for _, names in groups)
    row = depth * page
    tensors = [{"size": num_blocks * row, "layers": names, "layer_stride": page if block_outer else page * num_blocks,
                "block_stride": row if block_outer else page, "offset": 0, "host_resident": False}
               for _, names in groups]
    return {"num_blocks": num_blocks, "kv_cache_tensors": tensors, "kv_cache_layout": layout,
            "kv_cache_groups": [{"layer_names": names, "kv_cache_spec": spec} for spec, names in groups], **cfg}


CELL = (128 + 128) * 2  # K | V of one (head, token) cell, bf16


@pytest.mark.parametrize("layout, head_stride, token_stride", [("LBNHC", CELL, 4 * CELL), ("NHD", CELL, 4 * CELL),
                                                               ("LBHNC", 16 * CELL, CELL), ("HND", 16 * CELL, CELL)])
def test_llama3_8b_tp2_0_32_one_region_per_layer_kv_in_each_cell(layout: str, head_stride: int,
                                                                 token_stride: int) -> None:
    page = 16 * 4 * CELL  # 32768: vLLM 0.32's page_size_bytes, 16 tokens x 4 heads x 512 B
    geo = engine_from_vllm_config(layered(10, [(attn_spec(16, 4), LLAMA_LAYERS)], page, layout), tp=2,
                                  attention_backend="FLASH_ATTN")
    assert geo.regions == (Region(10, page),) * 32
    g = geo.groups[0]
    assert isinstance(g, AttentionGroupGeometry)
    assert g.layout == PageLayout(kv_stride=256, head_stride=head_stride, token_stride=token_stride)
    assert [v.regions for v in g.views] == [(i, i) for i in range(32)]  # K and V planes in the layer's region


def test_block_outer_layouts_one_region_layers_at_offsets() -> None:
    page = 16 * 4 * CELL
    geo = engine_from_vllm_config(layered(5, [(attn_spec(16, 4), LLAMA_LAYERS[:3])], page, "BLNHC", True), tp=2,
                                  attention_backend="TRITON_ATTN")
    assert geo.regions == (Region(5, 3 * page),)
    g = geo.groups[0]
    assert isinstance(g, AttentionGroupGeometry) and [v.offset for v in g.views] == [0, page, 2 * page]
    assert (g.layout.head_stride, g.layout.token_stride) == (CELL, 4 * CELL)
    # BHLNC: [B][H][L][N][C]: a head's rows of every layer in turn, so head_stride = 3 layers x 16 x 512
    # and layer l at l * 16 * 512 (vLLM's layer_stride = N * C)
    cfg = layered(5, [(attn_spec(16, 4), LLAMA_LAYERS[:3])], page, "BHLNC", True)
    cfg["kv_cache_tensors"][0]["layer_stride"] = 16 * CELL
    geo = engine_from_vllm_config(cfg, tp=2, attention_backend="FLASH_ATTN")
    g = geo.groups[0]
    assert isinstance(g, AttentionGroupGeometry)
    assert (g.layout.head_stride, g.layout.token_stride, g.layout.kv_stride) == (3 * 16 * CELL, CELL, 256)
    assert [v.offset for v in g.views] == [0, 16 * CELL, 2 * 16 * CELL]


def test_0_32_hybrid_overlay_and_kernel_pages() -> None:
    """Nemotron-H-like TP1 with 16-token kernel pages: groups alias from byte 0, layer i of every group in region i;
    the logical block is ppl = 65 kernel pages (docs/design.md §3.2's numbers)."""
    kernel_page = 2 * 8 * 16 * 256
    ppl = 65
    block, page = ppl * 16, ppl * kernel_page
    mamba = {**nemotron_mamba(1, block, page), "mamba_type": "mamba2"}
    cfg = layered(2, [(attn_spec(block, 8), ["a.4", "a.11"]), (mamba, ["m.0", "m.2"])], page, "LBHNC")
    geo = engine_from_vllm_config(cfg, tp=1, attention_backend="FLASH_ATTN", kernel_block_size=16,
                                  group_names=["attn", "mamba"], model_name="nemotron-h-8b-like")
    assert geo.regions == (Region(2 * ppl, kernel_page),) * 2 and geo.blocks_per_logical == ppl
    a, m = geo.groups
    assert isinstance(a, AttentionGroupGeometry) and isinstance(m, StateGroupGeometry)
    assert [v.regions[0] for v in a.views] == [0, 1] and [v.region for v in m.views] == [0, 1]
    assert a.layout == PageLayout(kv_stride=256, head_stride=16 * 512, token_stride=512)
    assert geo.model == get_preset("nemotron-h-tp1-tp4").factory(2, 2, 2)[0].model


def test_one_state_per_request_places_nothing_by_block_size() -> None:
    """mamba_cache_mode "none" (prefix caching off): vLLM sets the mamba group's block_size to max_model_len
    (512 here) while attention keeps its 128, and a request holds one state block; the state's page is the
    block id's page either way, so the engine's block is attention's. With "align" (or no mode given) the
    two block sizes must agree, as before."""
    # the conformance run's tiny Nemotron-H: 4 KV heads of 32 float32, mamba2 conv (320, 3), ssm (8, 32, 16)
    kernel_page = 2 * 4 * 128 * 32 * 4
    mamba = {"type": "MambaSpec", "block_size": 512, "shapes": [[320, 3], [8, 32, 16]],
             "dtypes": ["torch.float32", "torch.float32"], "page_size_padded": kernel_page, "mamba_type": "mamba2",
             "mamba_cache_mode": "none"}
    attn = attn_spec(128, 4, 32, dtype="torch.float32")
    cfg = layered(4, [(mamba, ["m.0", "m.2"]), (attn, ["a.1", "a.3"])], kernel_page, "LBHNC")
    geo = engine_from_vllm_config(cfg, tp=1, attention_backend="FLASH_ATTN", group_names=["mamba", "attn"])
    assert (geo.kernel_block_tokens, geo.blocks_per_logical) == (128, 1)
    assert geo.regions == (Region(4, kernel_page),) * 2
    for mode in ("align", None):
        refused = {**mamba, "mamba_cache_mode": mode} if mode else {k: v for k, v in mamba.items()
                                                                      if k != "mamba_cache_mode"}
        bad = layered(4, [(refused, ["m.0", "m.2"]), (attn, ["a.1", "a.3"])], kernel_page, "LBHNC")
        with pytest.raises(GeometryError, match="block sizes \\[128, 512\\]"):
            engine_from_vllm_config(bad, tp=1, attention_backend="FLASH_ATTN")


def test_0_32_spec_fields_vllm_objects_carry() -> None:
    """head_size_v = 0 for MLA, the enum mamba_type, max_tp_shards for replicated heads, UniformTypeKVCacheSpecs."""

    class MambaAttentionBackendEnum(enum.Enum):
        MAMBA2 = "vllm.v1.attention.backends.mamba2_attn.Mamba2AttentionBackend"

    mla = {"type": "MLAAttentionSpec", "block_size": 64, "num_kv_heads": 1, "head_size": 576, "head_size_v": 0,
           "dtype": "torch.bfloat16"}
    geo = engine_from_vllm_config(layered(3, [(mla, ["l0", "l1"])], 64 * 1152, "LBHNC"), tp=8,
                                  attention_backend="FLASHMLA")
    assert geo.model.groups[0].kind == "mla" and geo.groups[0].layout.token_stride == 1152  # type: ignore[union-attr]
    block, page = 65 * 16, 65 * 65536
    spec = {**nemotron_mamba(1, block, page), "mamba_type": MambaAttentionBackendEnum.MAMBA2}
    geo = engine_from_vllm_config(layered(2, [(attn_spec(block, 8), ["a"]), (spec, ["m"])], page, "LBHNC"), tp=1,
                                  attention_backend="FLASH_ATTN", kernel_block_size=16)
    assert [s.name for s in geo.model.groups[1].sections] == ["x", "B", "C", "ssm"]  # type: ignore[union-attr]
    # 1 KV head replicated over TP4 (max_tp_shards 1): the model has 1 head, not 4
    geo = engine_from_vllm_config(layered(2, [(attn_spec(16, 1, max_tp_shards=1), ["l0"])], 16 * CELL, "LBHNC"),
                                  tp=4, attention_backend="FLASH_ATTN")
    assert geo.model.groups[0].num_kv_heads == 1  # type: ignore[union-attr]
    uniform = {"type": "UniformTypeKVCacheSpecs", "block_size": 16,
               "kv_cache_specs": {"l0": attn_spec(16, 4), "l1": attn_spec(16, 4)}}
    geo = engine_from_vllm_config(layered(2, [(uniform, ["l0", "l1"])], 16 * 4 * CELL, "LBHNC"), tp=2,
                                  attention_backend="FLASH_ATTN")
    assert geo.model.groups[0].num_kv_heads == 8  # type: ignore[union-attr]


def test_0_32_refusals_name_the_field() -> None:
    page = 16 * 4 * CELL
    good = layered(4, [(attn_spec(16, 4), LLAMA_LAYERS[:2])], page, "LBHNC")
    t0 = good["kv_cache_tensors"][0]

    def with_tensor(**kw: Any) -> dict[str, Any]:
        return {**good, "kv_cache_tensors": [{**t0, **kw}]}

    mixed = {"type": "UniformTypeKVCacheSpecs", "block_size": 16,
             "kv_cache_specs": {"l0": attn_spec(16, 4), "l1": attn_spec(16, 4, head_size=64)}}
    cases: list[tuple[dict[str, Any], dict[str, Any], str]] = [
        (with_tensor(host_resident=True), {}, "kv_cache_config.kv_cache_tensors[0].host_resident"),
        ({**good, "kv_cache_layout": None}, {}, "kv_cache_config.kv_cache_layout"),
        ({**good, "kv_cache_layout": "LHBNC"}, {}, "kv_cache_config.kv_cache_layout"),
        (good, {"kv_cache_layout": "XYZ"}, "kv_cache_layout"),
        (with_tensor(block_stride=page - 1), {}, "kv_cache_config.kv_cache_tensors[0].block_stride"),
        (with_tensor(size=page), {}, "kv_cache_config.kv_cache_tensors[0].size"),
        (with_tensor(layer_stride=page), {}, "kv_cache_config.kv_cache_tensors[0].offset"),  # layers overlap partly
        (with_tensor(layers=["nope"]), {}, "kv_cache_config.kv_cache_tensors[0].layers"),
        (layered(4, [(attn_spec(16, 4), LLAMA_LAYERS[:2])], page, "BLHNC", True), {"kernel_block_size": 8},
         "kernel_block_size"),
        (layered(4, [(attn_spec(16, 4, head_size_v=64), LLAMA_LAYERS[:2])], page, "LBHNC"), {},
         "kv_cache_config.kv_cache_groups[0].kv_cache_spec.head_size_v"),
        (layered(4, [(attn_spec(16, 4, num_head_slots=2), LLAMA_LAYERS[:2])], page, "LBHNC"), {},
         "kv_cache_config.kv_cache_groups[0].kv_cache_spec.num_head_slots"),
        (layered(4, [(mixed, ["l0", "l1"])], page, "LBHNC"), {},
         "kv_cache_config.kv_cache_groups[0].kv_cache_spec.kv_cache_specs"),
        (good, {"attention_backend": "FLASHMLA"}, "attention_backend"),
        (config(9, [(attn_spec(16, 4), LLAMA_LAYERS[:2])], 2 * page), {"attention_backend": "CPU_ATTN"},
         "attention_backend"),  # the older shared_by set has no CPU backend
    ]
    for cfg, extra, path in cases:
        kw: dict[str, Any] = {"tp": 2, "attention_backend": "FLASH_ATTN", **extra}
        with pytest.raises(GeometryError) as err:
            engine_from_vllm_config(cfg, **kw)
        assert err.value.path == path, (path, str(err.value))
    # two tensors of different backing sizes
    two = layered(4, [(attn_spec(16, 4), LLAMA_LAYERS[:2]), (attn_spec(16, 4), LLAMA_LAYERS[2:4])], page, "LBHNC")
    two["kv_cache_tensors"][1] = {**two["kv_cache_tensors"][1], "size": 3 * 4 * page}
    with pytest.raises(GeometryError) as err:
        engine_from_vllm_config(two, tp=2, attention_backend="FLASH_ATTN")
    assert err.value.path == "kv_cache_config.kv_cache_tensors"


def test_0_32_geometries_plan_and_simulate() -> None:
    """P: Llama-3-8B-like TP2 FLASH_ATTN LBNHC; D: TP4 LBHNC with 8-token kernel pages of 16-token blocks."""
    layers = LLAMA_LAYERS[:4]
    P = engine_from_vllm_config(layered(9, [(attn_spec(16, 4), layers)], 16 * 4 * CELL, "LBNHC"), tp=2,
                                attention_backend="FLASH_ATTN", name="prefill")
    D = engine_from_vllm_config(layered(14, [(attn_spec(16, 2), layers)], 16 * 2 * CELL, "LBHNC"), tp=4,
                                attention_backend="FLASH_ATTN", kernel_block_size=8, name="decode")
    assert pairable(P, D) and D.blocks_per_logical == 2
    request = fresh_request(Pair(P, D), 100, decode_tokens=101)
    from kvgeom import simulate
    assert simulate(Pair(P, D), request, plan_transfer(P, D, request)).ok
