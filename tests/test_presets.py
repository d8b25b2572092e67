"""Every preset builds: pairable ones give a Pair and a request that fits it, the demo is rejected.

Expected sizes are the model facts of kvgeom/presets.py's docstring, recomputed here by hand.
"""

from __future__ import annotations

import math

import pytest

from kvgeom import (
    AttentionSpec,
    GeometryError,
    IncompatibleGeometry,
    KvGeomError,
    Pair,
    RequestError,
    StateSlots,
    StateSpec,
    pairable,
)
from kvgeom.building import DEFAULT_PRESET, PRESETS, UnknownPreset, get_preset, hybrid_blocks_per_logical

PAIRABLE = [name for name, p in PRESETS.items() if p.pairable]
SMALL = {"layers": 1}  # keep the tests fast: one layer per group (a pipeline-parallel preset: one per stage)


def _small(name: str) -> dict[str, int]:
    return {"layers": max(SMALL["layers"], PRESETS[name].min_layers)}


def test_required_presets_exist() -> None:
    names = set(PRESETS)
    assert {"llama3-70b-tp8-tp4", "llama3-70b-tp4-tp8", "deepseek-v3-tp8-tp1", "qwen-swa-tp2-tp4",
            "kimi-linear-tp8-tp1", "nemotron-h-tp1-tp4", "nemotron-h-tp4-tp1", "qwen3-next-tp2-tp4"} <= names
    assert DEFAULT_PRESET in PRESETS
    assert [p.name for p in PRESETS.values() if not p.pairable] == ["unpairable-fp8"]
    for name, p in PRESETS.items():
        assert p.name == name
        assert p.description and "\n" not in p.description


@pytest.mark.parametrize("name", PAIRABLE)
def test_pairable_presets_build(name: str) -> None:
    preset = PRESETS[name]
    pair, request = preset.build(**_small(name))
    assert isinstance(pair, Pair)
    pair.check_request(request)  # fits both engines
    assert request.computed_tokens == preset.default_tokens
    assert pairable(pair.prefill, pair.decode).ok
    assert (pair.prefill.name, pair.decode.name) == ("prefill", "decode")
    for spec in pair.model.groups:
        assert spec.num_layers == _small(name)["layers"]


@pytest.mark.parametrize("name", PAIRABLE)
def test_default_layers_build(name: str) -> None:
    """The default (real) layer counts build too; geometry construction allocates nothing."""
    preset = PRESETS[name]
    prefill, decode = preset.geometries()
    assert {g.num_layers for g in prefill.model.groups} == {preset.default_layers}
    assert pairable(prefill, decode).ok


@pytest.mark.parametrize("name", PAIRABLE)
def test_block_pools_are_a_few_times_the_request(name: str) -> None:
    """Every listed id is in range; pools hold the request, the leading ids and one spare block."""
    pair, request = PRESETS[name].build(**_small(name))
    for side, first in (("prefill", 1), ("decode", 2)):
        ids = []
        for g in request.groups:
            listing = getattr(g, side)
            ids.extend(listing.slot_ids if isinstance(listing, StateSlots) else listing.block_ids)
        engine = pair.side(side)
        assert min(ids) == first
        assert engine.num_logical_blocks(0) == max(ids) + 2  # ids 0..max plus one spare


def test_default_preset_is_small_and_interesting() -> None:
    preset = get_preset(DEFAULT_PRESET)
    pair, request = preset.build(preset.default_tokens, preset.default_prefix)
    p, d = pair.prefill, pair.decode
    assert (p.tp, d.tp) == (2, 4)
    assert (p.kernel_block_tokens, d.kernel_block_tokens) == (16, 8)
    assert request.prefix_hit_tokens == 16 and request.prefix_hit_tokens % d.logical_block_tokens == 0
    assert not any(isinstance(g, StateSpec) for g in pair.model.groups)
    # D lists [16, 100) in 8-token blocks: ceil(84 / 8) = 11 blocks from token 16
    listing = request.groups[0].decode
    assert listing.first_token == 16 and len(listing.block_ids) == math.ceil((100 - 16) / 8)
    # P lists [0, 100) in 16-token blocks: 7 blocks
    assert len(request.groups[0].prefill.block_ids) == 7
    # layouts differ: P token-major (NHD, head stride 256 B), D head-major (HND, head stride 8 * 256 B)
    assert p.groups[0].layout.head_stride == 256  # type: ignore[union-attr]
    assert d.groups[0].layout.head_stride == 8 * 256  # type: ignore[union-attr]


def test_model_facts() -> None:
    llama = PRESETS["llama3-70b-tp8-tp4"].geometries()[0].model.groups[0]
    assert isinstance(llama, AttentionSpec)
    assert (llama.num_layers, llama.num_kv_heads, llama.head_bytes) == (80, 8, 128 * 2)
    ds_p, ds_d = PRESETS["deepseek-v3-tp8-tp1"].geometries()
    mla = ds_p.model.groups[0]
    assert isinstance(mla, AttentionSpec)
    assert (mla.kind.value, mla.num_layers, mla.head_bytes) == ("mla", 61, (512 + 64) * 2)
    assert (ds_p.tp, ds_d.tp, ds_p.kernel_block_tokens, ds_d.kernel_block_tokens) == (8, 1, 64, 64)


def test_kimi_linear_block_sizes() -> None:
    p, d = PRESETS["kimi-linear-tp8-tp1"].geometries(layers=1)
    assert (p.tp, p.kernel_block_tokens, p.logical_block_tokens) == (8, 64, 768)
    assert (d.tp, d.kernel_block_tokens, d.logical_block_tokens) == (1, 64, 5760)
    # one KDA layer's state on TP1: conv q,k,v 3 x 4096 ch x 3 rows x 2 B + 32 heads x 128 x 128 x 4 B
    assert d.state_bytes(1) == 3 * 4096 * 3 * 2 + 32 * 128 * 128 * 4
    assert p.state_bytes(1) == d.state_bytes(1) // 8
    assert [g.name for g in p.model.groups] == ["mla", "kda_a", "kda_b"]
    assert len(p.regions) == 1  # shared: one region holds layer 0 of all three groups


def test_nemotron_h_logical_block_from_vllm_rule() -> None:
    p, d = PRESETS["nemotron-h-tp1-tp4"].geometries(layers=1)
    state_tp1 = 8192 * 3 * 2 + 1024 * 3 * 2 + 1024 * 3 * 2 + 128 * 64 * 128 * 4
    assert p.state_bytes(1) == state_tp1 == 4_255_744
    page_tp1 = 2 * 8 * 16 * 256
    assert p.blocks_per_logical == math.ceil(state_tp1 / page_tp1) == 65
    assert d.blocks_per_logical == math.ceil((state_tp1 // 4) / (page_tp1 // 4)) == 65
    sections = [s.name for s in p.model.groups[1].sections]  # type: ignore[union-attr]
    assert sections == ["x", "B", "C", "ssm"]
    assert {s.rows for s in p.model.groups[1].sections[:3]} == {4 - 1}  # type: ignore[union-attr]
    rp, rd = PRESETS["nemotron-h-tp4-tp1"].geometries(layers=1)
    assert (rp.tp, rd.tp) == (4, 1) and (p.tp, d.tp) == (1, 4)


def test_qwen3_next_ppl_differs_and_heads_replicate() -> None:
    p, d = PRESETS["qwen3-next-tp2-tp4"].geometries(layers=1)
    # TP2: 1 KV head x 2 planes x 16 tokens x 512 B = 16 KiB pages; state (2048+2048+4096)*3*2/2 + 16*65536
    state_tp2 = (2048 + 2048 + 4096) * 3 * 2 // 2 + 16 * 128 * 128 * 4
    assert p.blocks_per_logical == math.ceil(state_tp2 / (2 * 16 * 512)) == 66
    assert d.blocks_per_logical == math.ceil((state_tp2 // 2) / (2 * 16 * 512)) == 33
    assert d.local_heads(0) == 1 and d.holds(3)["attn"]["heads"].start == 3 * 2 // 4  # replicated head


def test_hybrid_requests_follow_the_mamba_n_minus_1_rule() -> None:
    preset = PRESETS["nemotron-h-tp1-tp4"]
    pair, request = preset.build(1040, layers=1)
    attn = request.groups[0]
    # P computed M = 1040 = one 1040-token block; D lists blocks for N = M + 1 = 1041 tokens: two
    assert len(attn.prefill.block_ids) == 1 and len(attn.decode.block_ids) == 2
    assert request.groups[1].decode.tokens == (1040,)  # the running state after M tokens
    assert preset.decode_tokens(1040) == 1041


def test_sliding_window_lists_tail_windows() -> None:
    pair, request = PRESETS["qwen-swa-tp2-tp4"].build(600, layers=1)
    sliding = request.groups[1]
    # P (16-token blocks) starts at (600 - 256) // 16 * 16 = 336; D (32-token blocks) at (600 - 256) // 32 * 32 = 320
    assert sliding.prefill.first_token == 336 and sliding.decode.first_token == 320
    assert request.groups[0].prefill.first_token == 0


def test_unpairable_demo() -> None:
    preset = PRESETS["unpairable-fp8"]
    prefill, decode = preset.geometries()
    compat = pairable(prefill, decode)
    assert not compat.ok
    paths = {r.path for r in compat.reasons}
    assert "decode.model.dtype" in paths
    assert any(p.endswith("head_bytes") for p in paths)
    with pytest.raises(IncompatibleGeometry):
        preset.build()


def test_get_preset_unknown_lists_names() -> None:
    with pytest.raises(UnknownPreset) as info:
        get_preset("llama-9000")
    assert isinstance(info.value, KvGeomError) and isinstance(info.value, ValueError)
    assert info.value.path == "preset"
    assert DEFAULT_PRESET in str(info.value) and "nemotron-h-tp1-tp4" in str(info.value)
    assert get_preset(DEFAULT_PRESET) is PRESETS[DEFAULT_PRESET]


def test_a_misspelled_preset_gets_a_did_you_mean() -> None:
    """Issue 20 (8): the fix names the closest presets; a name close to none gets no guess."""
    with pytest.raises(UnknownPreset) as info:
        get_preset("gqa-tp2-tp5")
    assert info.value.fix.startswith("did you mean 'gqa-tp2-tp4'")
    with pytest.raises(UnknownPreset) as far:
        get_preset("llama-9000")
    assert "did you mean" not in far.value.fix


def test_build_defaults_to_the_request_kvgeom_plan_plans() -> None:
    """Issue 20 (8): ``build()`` takes the preset's prefix as ``kvgeom plan`` does (S = 16 on the
    default preset), and drops it when it does not fit the tokens given."""
    import argparse

    from kvgeom.tools.cli import resolve_preset

    preset = PRESETS[DEFAULT_PRESET]
    assert preset.default_prefix == 16
    for tokens in (None, 100, 8):
        _, request = preset.build(tokens, layers=1)
        args = argparse.Namespace(preset=DEFAULT_PRESET, tokens=tokens, prefix=None)
        _, m, s = resolve_preset(args)
        assert (request.computed_tokens, request.prefix_hit_tokens) == (m, s) == \
            ((100 if tokens is None else tokens), (0 if tokens == 8 else 16))


@pytest.mark.parametrize(("kwargs", "path"), [
    ({"tokens": 0}, "tokens"),
    ({"tokens": 10.0}, "tokens"),
    ({"tokens": 10, "prefix": -8}, "prefix"),
    ({"tokens": 10, "prefix": 16}, "prefix"),
])
def test_build_rejects_bad_sizes(kwargs: dict[str, object], path: str) -> None:
    with pytest.raises(RequestError) as info:
        PRESETS[DEFAULT_PRESET].build(**kwargs)  # type: ignore[arg-type]
    assert info.value.path == path


def test_build_rejects_bad_layers_and_off_boundary_prefix() -> None:
    preset = PRESETS[DEFAULT_PRESET]
    preset.build(32, 8, layers=1)  # 8 is a D block boundary (8-token blocks)
    with pytest.raises(GeometryError) as g:
        preset.build(32, 8, layers=0)
    assert g.value.path == "layers"
    with pytest.raises(RequestError) as r:
        preset.build(32, 4, layers=1)
    assert r.value.path == "Request.prefix_hit_tokens"


def test_hybrid_blocks_per_logical_needs_attention() -> None:
    model = PRESETS["nemotron-h-tp1-tp4"].geometries(layers=1)[0].model
    assert hybrid_blocks_per_logical(model, tp=1, kernel_block_tokens=16) == 65
    state_only = type(model)("s", (model.groups[1],))
    with pytest.raises(GeometryError):
        hybrid_blocks_per_logical(state_only, tp=1, kernel_block_tokens=16)


def test_presets_are_deterministic() -> None:
    a = PRESETS["kimi-linear-tp1-tp8"].build(layers=1)
    b = PRESETS["kimi-linear-tp1-tp8"].build(layers=1)
    assert a[0].prefill == b[0].prefill and a[0].decode == b[0].decode and a[1] == b[1]
