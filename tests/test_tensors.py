"""EngineGeometry.from_tensors: the geometry read from cache tensors laid out as attention backends lay them out.

Each backend case allocates tensors the way the backend does (a shape, then a permutation for the
stride order, or views of one raw buffer) and compares the geometry read back with one written by
hand: the builder's geometry for the same layout and byte strides computed here as arithmetic.
The round trip property builds numpy views for every geometry the hypothesis strategies draw and
reads them back. Errors name the layer and the axis.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from numpy.lib.stride_tricks import as_strided

from kvgeom import (
    AttentionSpec,
    EngineGeometry,
    GeometryError,
    LayerTensors,
    ModelSpec,
    Pair,
    StateSection,
    StateSpec,
    fresh_request,
    simulate,
)
from kvgeom.building import get_preset
from kvgeom.tools import strategies as kst
from kvgeom.values import AttentionGroupGeometry, PageLayout, Region, StateGroupGeometry, TensorFacts, parse_axes

torch = pytest.importorskip("torch")

LLAMA = ModelSpec("llama-like", [AttentionSpec("attn", "full", num_layers=4, num_kv_heads=8, head_bytes=256)])


def backend_cache(shape: tuple[int, ...], order: tuple[int, ...], dtype: Any = None) -> Any:
    """What vLLM's model runner does: allocate in the stride order, then view in the logical order."""
    phys = torch.zeros(tuple(shape[i] for i in order), dtype=dtype or torch.bfloat16)
    return phys.permute(*[order.index(i) for i in range(len(order))])


NHD_ORDER, HND_ORDER = (0, 1, 2, 3, 4), (0, 1, 3, 2, 4)


# ---- attention backends ----------------------------------------------------------------------------

@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_flash_attention_kv_first(layout: str) -> None:
    """FlashAttention: (2, blocks, tokens, heads, dim); K and V are the two halves of the tensor."""
    blocks, K, H, D = 16, 16, 4, 128  # TP2 of 8 KV heads
    caches = [backend_cache((2, blocks, K, H, D), NHD_ORDER if layout == "NHD" else HND_ORDER) for _ in range(4)]
    geo = EngineGeometry.from_tensors(LLAMA, tp=2, layers=[LayerTensors("attn", "kv page token head dim", c)
                                                            for c in caches], name="prefill")
    hb = D * 2
    plane_page = K * H * hb  # one plane of one 16-token page: 16 * 4 * 256 = 16384 B
    assert geo.regions == (Region(blocks, plane_page),) * 8  # K half and V half of each of the 4 layers
    g = geo.groups[0]
    assert isinstance(g, AttentionGroupGeometry)
    if layout == "NHD":
        assert g.layout == PageLayout(kv_stride=0, head_stride=hb, token_stride=H * hb)
    else:
        assert g.layout == PageLayout(kv_stride=0, head_stride=K * hb, token_stride=hb)
    assert [v.regions for v in g.views] == [(0, 1), (2, 3), (4, 5), (6, 7)]
    assert geo == EngineGeometry.build(LLAMA, tp=2, kernel_block_tokens=K, num_blocks=blocks, layout=layout,  # type: ignore[arg-type]
                                       kv="split", name="prefill")


@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_flashinfer_blocks_first(layout: str) -> None:
    """FlashInfer: (blocks, 2, tokens, heads, dim); K and V side by side in every page."""
    blocks, K, H, D = 12, 16, 2, 128  # TP4
    caches = [backend_cache((blocks, 2, K, H, D), NHD_ORDER if layout == "NHD" else HND_ORDER) for _ in range(4)]
    geo = EngineGeometry.from_tensors(LLAMA, tp=4, layers=[LayerTensors("attn", "page kv token head dim", c)
                                                            for c in caches])
    hb = 256
    assert geo.regions == (Region(blocks, 2 * K * H * hb),) * 4  # 16384 B pages
    g = geo.groups[0]
    assert isinstance(g, AttentionGroupGeometry)
    assert g.layout.kv_stride == K * H * hb
    assert (g.layout.head_stride, g.layout.token_stride) == ((hb, H * hb) if layout == "NHD" else (K * hb, hb))
    assert geo == EngineGeometry.build(LLAMA, tp=4, kernel_block_tokens=K, num_blocks=blocks, layout=layout)  # type: ignore[arg-type]


def test_trtllm_on_blackwell_is_hnd_and_pairs_with_fa_nhd() -> None:
    """vLLM's TRT-LLM attention on Blackwell uses FlashInfer's blocks-first cache in HND order:
    physical (blocks, 2, heads, tokens, dim). Read both engines from tensors and check a transfer."""
    p_caches = [backend_cache((8, 2, 16, 1, 128), HND_ORDER) for _ in range(4)]  # TP8: 1 head per rank
    d_caches = [backend_cache((8, 2, 32, 2, 128), HND_ORDER) for _ in range(4)]  # TP4: 2 heads, 32-token pages
    for c in p_caches + d_caches:
        assert c.permute(0, 1, 3, 2, 4).is_contiguous()  # heads outside tokens in memory
    P = EngineGeometry.from_tensors(LLAMA, tp=8, layers=[LayerTensors("attn", "page kv token head dim", c)
                                                          for c in p_caches], name="prefill")
    D = EngineGeometry.from_tensors(LLAMA, tp=4, layers=[LayerTensors("attn", "page kv token head dim", c)
                                                          for c in d_caches], name="decode")
    g = D.groups[0]
    assert isinstance(g, AttentionGroupGeometry)
    assert g.layout == PageLayout(kv_stride=2 * 32 * 256, head_stride=32 * 256, token_stride=256)
    pair = Pair(P, D)
    request = fresh_request(pair, 100)
    assert simulate(pair, request, pair.plan(request)).ok


def test_flashmla_latent_pages() -> None:
    """FlashMLA: (blocks, 64, 576) bf16, one replicated latent of 1152 B per token."""
    mla = ModelSpec("deepseek-v3-like", [AttentionSpec("mla", "mla", 3, 1, 576 * 2)])
    caches = [torch.zeros(10, 64, 576, dtype=torch.bfloat16) for _ in range(3)]
    geo = EngineGeometry.from_tensors(mla, tp=8, layers=[LayerTensors("mla", "page token dim", c) for c in caches])
    assert geo.regions == (Region(10, 64 * 1152),) * 3
    assert geo.groups[0].layout.token_stride == 1152  # type: ignore[union-attr]
    assert geo == EngineGeometry.build(mla, tp=8, kernel_block_tokens=64, num_blocks=10)


def test_sglang_like_token_pools_split_into_pages() -> None:
    """SGLang-like pools: per layer a K and a V buffer of (pages * page_size, heads, dim), each its
    own allocation; the token axis is cut into pages of 16 (an einops composite axis)."""
    pages, page, H, D = 9, 16, 8, 128
    layers = [LayerTensors("attn", "(page token) head dim",
                           (torch.zeros(pages * page, H, D, dtype=torch.float16),
                            torch.zeros(pages * page, H, D, dtype=torch.float16))) for _ in range(4)]
    geo = EngineGeometry.from_tensors(LLAMA, tp=1, layers=layers, sizes={"token": page})
    assert geo.regions == (Region(pages, page * H * 256),) * 8
    assert geo.groups[0].layout == PageLayout(kv_stride=0, head_stride=256, token_stride=H * 256)  # type: ignore[union-attr]
    assert geo == EngineGeometry.build(LLAMA, tp=1, kernel_block_tokens=page, num_blocks=pages, layout="NHD",
                                       kv="split", name=geo.name)


def test_trtllm_pool_with_layers_inside_each_block() -> None:
    """TensorRT-LLM-like pools: (blocks, layers, 2, heads, tokens, dim), one tensor for the group;
    every layer is a view at ``layer * 2 * heads * tokens * 256`` inside each block."""
    blocks, K, H = 6, 32, 4
    pool = torch.zeros(blocks, 4, 2, H, K, 128, dtype=torch.bfloat16)
    geo = EngineGeometry.from_tensors(LLAMA, tp=2, layers=[LayerTensors("attn", "page layer kv head token dim", pool)])
    layer_bytes = 2 * H * K * 256  # 65536 B
    assert geo.regions == (Region(blocks, 4 * layer_bytes),)
    assert [v.offset for v in geo.groups[0].views] == [i * layer_bytes for i in range(4)]  # type: ignore[union-attr]
    assert geo == EngineGeometry.build(LLAMA, tp=2, kernel_block_tokens=K, num_blocks=blocks, layout="HND",
                                       regions="interleaved")


def test_numpy_arrays_work_too() -> None:
    caches = [np.zeros((12, 2, 2, 16, 128), dtype=np.float16) for _ in range(4)]  # HND blocks-first
    geo = EngineGeometry.from_tensors(LLAMA, tp=4, layers=[LayerTensors("attn", "page kv head token dim", c)
                                                            for c in caches])
    assert geo == EngineGeometry.build(LLAMA, tp=4, kernel_block_tokens=16, num_blocks=12, layout="HND")


# ---- hybrid overlay: mamba state views on attention pages -------------------------------------------

@pytest.mark.parametrize("name", ["nemotron-h-tp1-tp4", "qwen3-next-tp2-tp4"])
def test_vllm_hybrid_overlay_reads_as_the_preset(name: str) -> None:
    """vLLM's hybrid layout: one raw int8 buffer per layer slot, shared by attention layer i (a
    blocks-first (kernel pages, 2, heads, tokens, dim) view) and mamba layer i (conv state
    (blocks, conv channels, kernel - 1) in DS layout, then the ssm state at its byte offset, both
    with the logical page as their first stride)."""
    for ref in get_preset(name).geometries(300):
        attn, state = ref.model.groups
        assert isinstance(attn, AttentionSpec) and isinstance(state, StateSpec)
        tp, ppl, K = ref.tp, ref.blocks_per_logical, ref.kernel_block_tokens
        H = max(1, attn.num_kv_heads // tp)
        page = ref.regions[0].page_bytes
        blocks = ref.regions[0].num_pages // ppl
        conv = [s for s in state.sections if s.rows > 1]
        ssm = [s for s in state.sections if s.rows == 1]
        assert len(ssm) == 1
        conv_ch = sum(s.channels for s in conv) // tp
        heads = ssm[0].channels // tp
        d_state = ssm[0].unit_bytes // 4 // 128  # ssm units are (head_dim x state) fp32; head_dim 64 or 128
        head_dim = ssm[0].unit_bytes // 4 // d_state
        layers = []
        for i in range(attn.num_layers):
            raw = torch.zeros(ref.regions[i].nbytes, dtype=torch.int8)
            kv = raw.view(torch.bfloat16).view(blocks * ppl, 2, H, K, attn.head_bytes // 2)
            layers.append(LayerTensors("attn", "page kv head token dim", kv, name=f"model.layers.{2 * i}.attn"))
            lp = page * ppl  # the logical page: a state slot
            conv_t = torch.as_strided(raw.view(torch.bfloat16), (blocks, conv_ch, 3), (lp // 2, 3, 1))
            ssm_t = torch.as_strided(raw.view(torch.float32), (blocks, heads, head_dim, d_state),
                                     (lp // 4, head_dim * d_state, d_state, 1), conv_ch * 3 * 2 // 4)
            sections = " ".join(s.name for s in conv)
            layers.append(LayerTensors(state.name, {sections: "page channel row", ssm[0].name: "page channel hd ds"},
                                       {sections: conv_t, ssm[0].name: ssm_t}, name=f"model.layers.{2 * i + 1}.mixer"))
        geo = EngineGeometry.from_tensors(ref.model, tp=tp, layers=layers, name=ref.name)
        assert geo.blocks_per_logical == ppl  # read from the state page over the attention page
        assert geo == ref


# ---- errors name the layer and the axis ----------------------------------------------------------------

def fi_layers(n: int = 4, **kw: Any) -> list[LayerTensors]:
    return [LayerTensors("attn", "page kv head token dim", torch.zeros(8, 2, 2, 16, 128, dtype=torch.bfloat16),
                         name=f"layers.{i}") for i in range(n)]


def test_non_contiguous_head_vectors_are_refused() -> None:
    layers = fi_layers()
    bad = LayerTensors("attn", "page kv head dim token", layers[1].tensors, name="layers.1")  # dim <-> token swapped
    with pytest.raises(GeometryError, match="not contiguous") as err:
        EngineGeometry.from_tensors(LLAMA, tp=4, layers=[layers[0], bad, *layers[2:]])
    assert err.value.path == "engine.layers.1.dim"


def test_overlapping_views_of_different_layers_are_refused() -> None:
    layers = fi_layers()
    twin = LayerTensors("attn", layers[0].axes, layers[0].tensors, name="layers.3")  # layer 3 aliases layer 0
    with pytest.raises(GeometryError, match="overlap layers.0") as err:
        EngineGeometry.from_tensors(LLAMA, tp=4, layers=[*layers[:3], twin])
    assert err.value.path == "engine.layers.3"


def test_a_page_stride_smaller_than_the_page_is_refused() -> None:
    # K and V tensors of (pages, heads, tokens, dim) whose pages hold 2 * 16 * 256 = 8192 B but start 4096 B apart
    k, v = (torch.as_strided(torch.zeros(16 * 4096, dtype=torch.bfloat16), (8, 2, 16, 128), (2048, 2048, 128, 1))
            for _ in range(2))
    layers = fi_layers()
    with pytest.raises(GeometryError, match="page stride of 4096 B is smaller than the page it holds") as err:
        EngineGeometry.from_tensors(LLAMA, tp=4, layers=[LayerTensors("attn", "page head token dim", (k, v),
                                                                       name="layers.0"), *layers[1:]])
    assert err.value.path == "engine.layers.0.page"


def test_a_tensor_outside_every_registered_region_is_refused() -> None:
    layers = fi_layers()
    others = [torch.zeros(8 * 16384, dtype=torch.uint8) for _ in range(4)]
    with pytest.raises(GeometryError, match="not in any registered region") as err:
        EngineGeometry.from_tensors(LLAMA, tp=4, layers=layers, regions=[layers[0].tensors, *others[1:]])
    assert err.value.path == "engine.layers.1"


def test_wrong_head_count_and_kernel_page_are_named() -> None:
    with pytest.raises(GeometryError, match="2 heads per rank") as err:
        EngineGeometry.from_tensors(LLAMA, tp=2, layers=fi_layers())
    assert err.value.path == "engine.layers.0.head"
    layers = fi_layers()
    layers[2] = LayerTensors("attn", "page kv head token dim", torch.zeros(16, 2, 2, 8, 128, dtype=torch.bfloat16),
                             name="layers.2")
    with pytest.raises(GeometryError, match="8 tokens per page") as err:
        EngineGeometry.from_tensors(LLAMA, tp=4, layers=layers)
    assert err.value.path == "engine.layers.2.token"


def test_axis_descriptions_are_parsed_einops_style() -> None:
    assert parse_axes("(block token) head dim") == [["page", "token"], ["head"], ["dim"]]
    for bad, what in (("page page dim", "twice"), ("(page (token)) dim", "nested"), ("page token)", "unbalanced"),
                      ("page + dim", "unexpected"), ("", "empty")):
        with pytest.raises(GeometryError, match=what):
            parse_axes(bad)
    with pytest.raises(GeometryError, match="names 4 dimensions, the tensor has 5"):
        EngineGeometry.from_tensors(LLAMA, tp=4, layers=[LayerTensors("attn", "page kv token dim", c.tensors)
                                                          for c in fi_layers()])


# ---- the round trip over every drawn geometry ------------------------------------------------------

def numpy_tensors(e: EngineGeometry) -> tuple[list[np.ndarray], list[LayerTensors]]:
    """One uint8 buffer per region and, per layer, strided views at the geometry's own strides.

    Every axis is named (a kv axis of 1 for MLA, a head axis of 1 for one head), so the geometry's
    strides travel even where a size-1 axis makes them irrelevant."""
    bufs = [np.zeros(r.nbytes, np.uint8) for r in e.regions]
    layers: list[LayerTensors] = []
    for spec, g in zip(e.model.groups, e.groups):
        if isinstance(g, AttentionGroupGeometry) and isinstance(spec, AttentionSpec):
            lay, h, K, hb = g.layout, e.local_heads(e.model.group_index(spec.name)), e.kernel_block_tokens, spec.head_bytes
            for v in g.views:
                r0 = v.regions[0]
                P, pb = e.regions[r0].num_pages, e.regions[r0].page_bytes
                if spec.planes == 2 and v.regions[0] != v.regions[1]:
                    k, vv = (as_strided(bufs[r][v.offset:], (P, h, K, hb), (pb, lay.head_stride, lay.token_stride, 1))
                             for r in v.regions)
                    layers.append(LayerTensors(spec.name, "page head token dim", (k, vv)))
                else:
                    t = as_strided(bufs[r0][v.offset:], (P, spec.planes, h, K, hb),
                                   (pb, lay.kv_stride, lay.head_stride, lay.token_stride, 1))
                    layers.append(LayerTensors(spec.name, "page kv head token dim", t))
        elif isinstance(g, StateGroupGeometry) and isinstance(spec, StateSpec):
            places = e.state_sections(e.model.group_index(spec.name))
            for sv in g.views:
                lp = e.logical_page_bytes(sv.region)
                slots = e.num_logical_blocks(sv.region)
                tensors = {p.name: as_strided(bufs[sv.region][sv.offset + p.offset:],
                                              (slots, p.local_channels, p.rows, p.unit_bytes),
                                              (lp, p.channel_stride, p.row_stride, 1)) for p in places}
                layers.append(LayerTensors(spec.name, "page channel row unit", tensors))
    return bufs, layers


def _state_layout(e: EngineGeometry) -> Any:
    return next((g.layout for g in e.groups if isinstance(g, StateGroupGeometry)), None)


@settings(max_examples=150, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow])
# one rank's tensors: one stage; plain layouts (a drawn per-plane layout's tiled token axis spans two tensor
# dimensions, which an axis description cannot say: tests/test_cpu_attn.py reads per-plane tensors)
@given(kst.engines(kst.models(max_groups=3), name="drawn", topology_probability=0.0, per_plane_probability=0.0))
def test_round_trip_over_drawn_geometries(e: EngineGeometry) -> None:
    bufs, layers = numpy_tensors(e)
    common = dict(tp=e.tp, layers=layers, kernel_block_tokens=e.kernel_block_tokens,
                  blocks_per_logical=e.blocks_per_logical, state_layout=_state_layout(e), name="drawn")
    assert EngineGeometry.from_tensors(e.model, regions=bufs, **common) == e  # the executor's buffers
    assert EngineGeometry.from_tensors(e.model, **common) == e  # regions derived from the allocations


def test_round_trip_worked_example() -> None:
    """One hand-checked case of the helper: a hybrid on shared regions, state_major."""
    model = ModelSpec("h", [AttentionSpec("attn", "full", 2, 4, 16),
                            StateSpec("m", 2, [StateSection("x", 4, 2, rows=3), StateSection("ssm", 2, 8)])])
    e = EngineGeometry.build(model, tp=2, kernel_block_tokens=4, num_blocks=3, blocks_per_logical=2,
                             regions="shared", state_layout="state_major")
    bufs, layers = numpy_tensors(e)
    assert [b.size for b in bufs] == [6 * 256] * 2  # 2 planes x 2 heads x 4 tokens x 16 B = 256 B pages
    assert EngineGeometry.from_tensors(model, tp=2, layers=layers, state_layout="state_major") == e
    facts = TensorFacts((3,), (1,), 1, 0)
    assert facts.contiguous and facts.nbytes == 3


def test_state_sections_out_of_place_are_named() -> None:
    """The ssm state first and the conv state after it: not where kvgeom places the sections."""
    model = ModelSpec("h", [AttentionSpec("attn", "full", 1, 2, 256),
                            StateSpec("mamba", 1, [StateSection("x", 8, 2, rows=3), StateSection("ssm", 2, 64)])])
    ref = EngineGeometry.build(model, tp=1, kernel_block_tokens=16, num_blocks=4, blocks_per_logical=1,
                               regions="shared")
    raw = torch.zeros(ref.regions[0].nbytes, dtype=torch.int8)
    kv = raw.view(torch.bfloat16).view(4, 2, 2, 16, 128)
    page = ref.regions[0].page_bytes
    ssm = torch.as_strided(raw, (4, 2, 64), (page, 64, 1))
    conv = torch.as_strided(raw.view(torch.bfloat16), (4, 8, 3), (page // 2, 3, 1), 128 // 2)  # after the ssm
    layers = [LayerTensors("attn", "page kv head token dim", kv, name="layers.0.attn"),
              LayerTensors("mamba", {"x": "page channel row", "ssm": "page channel unit"}, {"x": conv, "ssm": ssm},
                           name="layers.1.mixer")]
    with pytest.raises(GeometryError, match="section 'ssm'") as err:
        EngineGeometry.from_tensors(model, tp=1, layers=layers)
    assert err.value.path == "engine.layers.1.mixer.channel"
    good = torch.as_strided(raw.view(torch.bfloat16), (4, 8, 3), (page // 2, 3, 1))
    late = torch.as_strided(raw, (4, 2, 64), (page, 64, 1), 8 * 3 * 2)
    layers[1] = LayerTensors("mamba", {"x": "page channel row", "ssm": "page channel unit"}, {"x": good, "ssm": late})
    assert EngineGeometry.from_tensors(model, tp=1, layers=layers) == ref


def test_registered_regions_must_be_whole_pages() -> None:
    layers = fi_layers(4)
    bufs: list[Any] = [(lay.tensors.data_ptr(), lay.tensors.numel() * 2) for lay in layers]
    bufs[2] = (bufs[2][0], bufs[2][1] + 100)
    with pytest.raises(GeometryError, match="not whole pages") as err:
        EngineGeometry.from_tensors(LLAMA, tp=4, layers=layers, regions=bufs)
    assert err.value.path == "engine.regions[2]"


@pytest.mark.parametrize(("axes", "typo", "meant"), [("page kv tokens head dim", "tokens", "token"),
                                                     ("blocks kv token head dim", "blocks", "block"),
                                                     ("page kv token heads dim", "heads", "head")])
def test_a_misspelled_axis_is_named(axes: str, typo: str, meant: str) -> None:
    """Issue 20 (8): ``"tokens"`` was read as an element axis and refused as a stride problem; the
    error now names the word and the axis it resembles. Element names far from every axis pass."""
    import numpy as np

    from kvgeom import AttentionSpec, EngineGeometry, GeometryError, LayerTensors, ModelSpec

    m = ModelSpec("m", [AttentionSpec("attn", "full", 1, 4, 256)])
    a = np.zeros((8, 2, 16, 4, 256), np.uint8)
    with pytest.raises(GeometryError) as info:
        EngineGeometry.from_tensors(m, tp=1, layers=[LayerTensors("attn", axes, a)])
    assert info.value.path.endswith(".axes") and info.value.actual == typo
    assert f"did you mean {meant!r}" in info.value.message
    ok = EngineGeometry.from_tensors(m, tp=1, layers=[LayerTensors("attn", "page kv token head hd", a)])
    assert ok.regions[0].page_bytes == 2 * 16 * 4 * 256
