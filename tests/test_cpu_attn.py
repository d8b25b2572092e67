"""Per-plane page layouts (docs/design.md §3.5) on vLLM's CPU attention pages, block 32, 64 and 96.

* vLLM's own kernel: tests/cpu_attn_pages.py runs under the vLLM venv, fills P's caches with
  ``cpu_attn_reshape_and_cache``, applies kvgeom's plan to the raw bytes and compares D's listed
  blocks with what the same kernel writes at D's slots, for every pair of block sizes (and D TP2);
  two wrong beliefs about K (rows in token order; 32-token tiles of rows) are the controls that
  must differ.
* The simulator: the same pairs planned and simulated in this process (its address arithmetic
  is a slot table, the planner's a digit by digit division), with a planner broken on purpose as
  the control.
* Hand-checked numbers: design §3.5's worked offsets, and the engine rules' typed refusals.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from vllm_env import ROOT, run_in_vllm

from kvgeom import (
    AttentionSpec,
    EngineGeometry,
    GeometryError,
    IncompatibleGeometry,
    ModelSpec,
    Pair,
    PlaneLayout,
    PlanesLayout,
    cpu_attn_layout,
    fresh_request,
    simulate,
)
from kvgeom.planning.transfer import plan_reference
from kvgeom.tools.serialize import dumps, loads
from kvgeom.values.layout import AttentionGroupGeometry, AttentionView, Region

SIZES = (32, 64, 96)


def _model(hd: int = 64, eb: int = 4, heads: int = 4, layers: int = 2) -> ModelSpec:
    return ModelSpec("tiny", (AttentionSpec("attn", "full", layers, heads, hd * eb),),
                     dtype="float32" if eb == 4 else "bfloat16")


def _engine(bs: int, tp: int = 1, isa: str = "vec", **kw: object) -> EngineGeometry:
    eb = 2 if isa == "amx" else 4
    return EngineGeometry.build(_model(eb=eb), tp=tp, kernel_block_tokens=bs, num_blocks=12, layout="CPU_ATTN",
                                cpu_isa=isa, name=f"e{bs}", **kw)  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def vllm_cells() -> list[dict[str, object]]:
    return run_in_vllm(str(ROOT / "tests" / "cpu_attn_pages.py"), timeout_s=1200)["cells"]  # type: ignore[no-any-return]


def test_vllm_kernel_pages_move_exactly(vllm_cells: list[dict[str, object]]) -> None:
    """kvgeom's plan puts every K and V byte where vLLM's own kernel puts it on D (all 9 block pairs,
    D TP1 and TP2, head_dim 64 and 32, and the amx kernel's bf16 pages): the direct plan, and the
    packed plan in several chunks (packs through P's per-plane mapping, unpacks through D's)."""
    vec = {(c["p"], c["d"], c["d_tp"]) for c in vllm_cells if c["isa"] == "vec" and c["hd"] == 64}
    assert vec == set(itertools.product(SIZES, SIZES, (1, 2)))
    assert {(c["p"], c["d"]) for c in vllm_cells if c["isa"] == "amx"} == {
        (a, b) for a in SIZES for b in SIZES if a != b}
    bad = [c for c in vllm_cells if not (c["equal"] and c["packed_equal"])]
    assert bad == []
    assert all(int(c["packed_chunks"]) > 1 for c in vllm_cells)  # type: ignore[call-overload]


def test_vllm_wrong_beliefs_fail(vllm_cells: list[dict[str, object]]) -> None:
    """The controls: believing K rows are in token order, or tiled by 32 tokens, gives D bytes that
    differ from vLLM's in every cell (also at equal block sizes: D's tail zeros land on wrong bytes),
    with the direct plan and, for the first belief, with the packed plan."""
    assert all(not c["rows_equal"] and not c["tiled32_equal"] and not c["packed_rows_equal"] for c in vllm_cells)


def test_vllm_k_order_is_transposed(vllm_cells: list[dict[str, object]]) -> None:
    """Where vLLM's vec kernel put K of token 37, head 1 (elements 0, 1, 2), inside the head's K half:
    element d at d * bs + s (s = 37 % bs), by hand; amx: (s // 16) * 16 * hd + (d // 2) * 32 + (s % 16) * 2 + d % 2."""
    for c in vllm_cells:
        for side in ("p", "d"):
            bs, s = int(c[side]), 37 % int(c[side])  # type: ignore[call-overload]
            if c["isa"] == "vec":
                want = [d * bs + s for d in range(3)]
            else:
                hd = int(c["hd"])  # type: ignore[call-overload]
                want = [(s // 16) * 16 * hd + (d // 2) * 32 + (s % 16) * 2 + d % 2 for d in range(3)]
            assert c[f"k37_{side}"] == want, (c, side)


@pytest.mark.parametrize("bp,bd,d_tp", [(a, b, t) for a in SIZES for b in SIZES for t in (1, 2)])
def test_simulator_passes_cpu_attn_pairs(bp: int, bd: int, d_tp: int) -> None:
    pair = Pair(_engine(bp), _engine(bd, tp=d_tp))
    req = fresh_request(pair, 150, prefix_hit_tokens=0, prefill_first_block=1, decode_first_block=2)
    for strategy in ("direct", "staged", "auto"):
        plan = plan_reference(pair, req, strategy=strategy)  # type: ignore[arg-type]
        rep = simulate(pair, req, plan)
        assert rep.ok, (strategy, str(rep)[:2000])


def test_simulator_passes_amx_and_prefix() -> None:
    pair = Pair(_engine(32, isa="amx"), _engine(96, isa="amx"))
    req = fresh_request(pair, 200, prefix_hit_tokens=96, prefill_first_block=3, decode_first_block=1)
    assert simulate(pair, req, plan_reference(pair, req)).ok


def test_simulator_catches_a_planner_that_ignores_byte_modes(monkeypatch: pytest.MonkeyPatch) -> None:
    """Control: a planner that treats every head vector as contiguous (what it did before §3.5)
    is caught by the simulator, whose own byte tables say otherwise."""
    from kvgeom.planning import attention

    monkeypatch.setattr(attention, "vector_unit", lambda spec, sides, plane: (spec.head_bytes, []))
    pair = Pair(_engine(32), _engine(64))
    req = fresh_request(pair, 100)
    rep = simulate(pair, req, plan_reference(pair, req, budget=None))
    assert not rep.ok


def test_simulator_catches_a_planner_that_ignores_token_modes(monkeypatch: pytest.MonkeyPatch) -> None:
    """Control: the amx K axis (16-token tiles) read as one stride is caught."""
    monkeypatch.setattr(PlaneLayout, "slot_offset", lambda self, slot: np.asarray(slot) * self.token_stride)
    pair = Pair(_engine(32, isa="amx"), _engine(64, isa="amx"))
    req = fresh_request(pair, 100)
    assert not simulate(pair, req, plan_reference(pair, req, budget=None)).ok


def test_design_worked_number() -> None:
    """docs/design.md §3.5: vec, block 64, head_dim 128 float32, 2 heads: K of token 37, head 1 at
    65536 + 37 * 4 = 65684, its element 1 at 65940; V of it at 65536 + 32768 + 37 * 512 = 117248."""
    model = ModelSpec("m", (AttentionSpec("attn", "full", 1, 2, 512),), dtype="float32")
    e = EngineGeometry.build(model, tp=1, kernel_block_tokens=64, num_blocks=2, layout="CPU_ATTN")
    assert e.regions[0].page_bytes == 2 * 2 * 64 * 512
    _, k = e.attention_address(0, 0, 0, 0, 37, 1)
    _, v = e.attention_address(0, 0, 1, 0, 37, 1)
    assert (int(k), int(v)) == (65684, 117248)
    assert int(e.attention_vector_bytes(0, 0)[4]) == 256  # element 1 of the K vector
    assert int(k) + 256 == 65940
    assert e.attention_vector_bytes(0, 1).tolist() == list(range(512))  # V: contiguous


def test_plain_layouts_stay_page_layouts() -> None:
    """HND/NHD engines keep PageLayout (their documents do not mention planes)."""
    m = _model()
    e = EngineGeometry.build(m, tp=1, kernel_block_tokens=32, num_blocks=4)
    assert "planes" not in dumps(e) and "PageLayout" in dumps(e)


def test_pair_file_round_trip() -> None:
    pair = Pair(_engine(64), _engine(32, isa="vec", tp=2))
    assert loads(dumps(pair)) == pair


def _group(layout: PlanesLayout, page: int, layers: int = 1, hb: int = 8) -> dict[str, object]:
    return dict(model=ModelSpec("m", (AttentionSpec("a", "full", layers, 1, hb),), dtype="int8"), tp=1,
                kernel_block_tokens=4, blocks_per_logical=1, regions=(Region(2, page),),
                groups=(AttentionGroupGeometry(layout, tuple(AttentionView((0, 0), 0) for _ in range(layers))),))


def test_rules_name_plane_and_axis() -> None:
    ok = PlanesLayout((PlaneLayout(0, 64, ((4, 8),)), PlaneLayout(32, 64, ((4, 8),))))
    EngineGeometry(**_group(ok, 64))  # type: ignore[arg-type]
    bad_tokens = PlanesLayout((PlaneLayout(0, 64, ((2, 8),)), PlaneLayout(32, 64, ((4, 8),))))
    with pytest.raises(GeometryError, match=r"planes\[0\]\.token_modes"):
        EngineGeometry(**_group(bad_tokens, 64))  # type: ignore[arg-type]
    bad_bytes = PlanesLayout((PlaneLayout(0, 64, ((4, 8),), ((2, 1), (2, 4))), PlaneLayout(32, 64, ((4, 8),))))
    with pytest.raises(GeometryError, match=r"planes\[0\]\.vector_modes"):
        EngineGeometry(**_group(bad_bytes, 64))  # type: ignore[arg-type]
    overflow = PlanesLayout((PlaneLayout(0, 64, ((4, 8),)), PlaneLayout(40, 64, ((4, 8),))))
    with pytest.raises(GeometryError, match=r"planes\[1\]"):
        EngineGeometry(**_group(overflow, 64))  # type: ignore[arg-type]
    overlap = PlanesLayout((PlaneLayout(0, 64, ((4, 8),)), PlaneLayout(28, 64, ((4, 8),))))  # V token 0 in K's
    with pytest.raises(GeometryError, match="overlap"):
        EngineGeometry(**_group(overlap, 64))  # type: ignore[arg-type]
    huge = ModelSpec("m", (AttentionSpec("a", "full", 1, 1, 1 << 21),), dtype="int8")
    big = PlanesLayout((PlaneLayout(0, 4 << 21, ((4, 2),), ((2, 1), (1 << 20, 8))), PlaneLayout(4 << 21, 4 << 21, ((4, 1 << 21),))))
    with pytest.raises(GeometryError, match="split in byte modes exceed"):  # before any 2**21-entry table exists
        EngineGeometry(model=huge, tp=1, kernel_block_tokens=4, blocks_per_logical=1, regions=(Region(1, 8 << 21),),
                       groups=(AttentionGroupGeometry(big, (AttentionView((0, 0), 0),)),))
    # interleaved planes (K and V of a token side by side) do not nest as cells, but are apart: enumerated
    inner = PlanesLayout((PlaneLayout(0, 64, ((4, 16),)), PlaneLayout(8, 64, ((4, 16),))))
    EngineGeometry(**_group(inner, 64))  # type: ignore[arg-type]


def test_cpu_attn_refusals() -> None:
    with pytest.raises(GeometryError, match="multiples of 32"):
        cpu_attn_layout(heads=1, block_size=16, head_bytes=256, element_bytes=2)
    with pytest.raises(GeometryError, match="isa"):
        cpu_attn_layout(heads=1, block_size=32, head_bytes=256, element_bytes=2, isa="neon")
    with pytest.raises(GeometryError, match="amx"):
        cpu_attn_layout(heads=1, block_size=32, head_bytes=160, element_bytes=2, isa="amx")


def test_dcp_with_a_per_plane_layout_is_refused_by_name() -> None:
    """DCP token shards on an engine with a per-plane layout: a typed refusal naming the engine's dcp
    field, both values and the fix (docs/design.md §3.5: a DCP side cuts at every interleave chunk, which
    need not fall on a plane's affine pieces). The other side may shard its tokens: that pair plans."""
    from kvgeom import Topology

    with pytest.raises(GeometryError) as e:
        _engine(64, tp=2, topology=Topology(dcp=2))
    assert e.value.path == "e64.topology.dcp" and e.value.actual == 2 and e.value.expected == 1
    assert "per-plane" in str(e.value) and "dcp=1" in (e.value.fix or "")
    P = EngineGeometry.build(_model(), tp=2, kernel_block_tokens=32, num_blocks=12, topology=Topology(dcp=2), name="P")
    pair = Pair(P, _engine(64))
    req = fresh_request(pair, 150)
    for strategy in ("direct", "packed", "auto"):
        assert simulate(pair, req, plan_reference(pair, req, strategy=strategy)).ok  # type: ignore[arg-type]


def test_pair_refuses_byte_modes_that_do_not_refine() -> None:
    """6-byte head vectors split 2 x 3 on one side and 3 x 2 on the other share no piece size."""
    v = PlaneLayout(48, 72, ((4, 6),))
    a = PlanesLayout((PlaneLayout(0, 72, ((4, 2),), ((2, 1), (3, 16))), v))
    b = PlanesLayout((PlaneLayout(0, 72, ((4, 3),), ((3, 1), (2, 16))), v))
    c = PlanesLayout((PlaneLayout(0, 72, ((4, 6),), ((2, 1), (3, 2))), v))  # contiguous, said in two modes
    ea, eb, ec = (EngineGeometry(**_group(x, 72, hb=6), name=n) for x, n in ((a, "P"), (b, "D"), (c, "C")))  # type: ignore[arg-type]
    Pair(ea, ea)
    Pair(eb, ec)
    Pair(ea, ec)
    with pytest.raises(IncompatibleGeometry, match="vector_modes"):
        Pair(ea, eb)


@pytest.mark.parametrize("bs", SIZES)
def test_from_tensors_reads_cpu_attn_views(bs: int) -> None:
    """CPU_ATTN's caches read through views of vLLM's registered tensor (K: the transposed
    [head_dim][bs] half, V: the chunk vLLM's kernel reads) give the builder's geometry."""
    torch = pytest.importorskip("torch")
    from kvgeom.values.tensors import LayerTensors

    hd, h, nb = 64, 4, 6
    model = _model(hd=hd, heads=h)
    layers = []
    for _ in range(2):
        c = torch.zeros(nb, h, bs, 2 * hd)  # [num_blocks, heads, block_size, 2 * head_dim], as vLLM registers it
        k = c.view(nb, h, 2, hd, bs)[:, :, 0].transpose(-1, -2)
        v = c.view(nb, h, 2 * bs, hd).chunk(2, dim=2)[1]
        layers.append(LayerTensors("attn", "page head token dim", (k, v)))
    got = EngineGeometry.from_tensors(model, tp=1, layers=layers)
    want = EngineGeometry.build(model, tp=1, kernel_block_tokens=bs, num_blocks=nb, layout="CPU_ATTN")
    assert got.groups == want.groups and got.regions == want.regions


@pytest.mark.parametrize("bs", SIZES)
def test_from_tensors_reads_amx_pages_with_token_parts(bs: int) -> None:
    """The amx kernel's bf16 pages read from views of vLLM's registered tensor with the token axis in
    parts (docs/design.md §10.1): K as ``[.., bs/16, hd/2, 16, 2]`` and V as ``[.., hd/16, bs/2, 16, 2]``
    permuted to the same names, both "page head token1 d1 token0 d0" (token0 the least significant
    part); the result is the builder's ``layout="CPU_ATTN", cpu_isa="amx"`` geometry. Controls: the
    parts swapped read as another layout; a token axis beside token parts, and parts not numbered
    from token0, are refused by name."""
    torch = pytest.importorskip("torch")
    from kvgeom.values.tensors import LayerTensors

    hd, h, nb = 64, 4, 6
    model = _model(hd=hd, eb=2, heads=h)

    def read(axes: str) -> EngineGeometry:
        layers = []
        for _ in range(2):
            c = torch.zeros(nb, h, bs, 2 * hd, dtype=torch.bfloat16)  # [num_blocks, heads, bs, 2 * hd], as vLLM
            kv = c.view(nb, h, 2, bs * hd)  # per head: bs * hd elements of K, then of V
            k = kv[:, :, 0].view(nb, h, bs // 16, hd // 2, 16, 2)  # token s = 16 t1 + t0, element d = 2 d1 + d0
            v = kv[:, :, 1].view(nb, h, hd // 16, bs // 2, 16, 2).permute(0, 1, 3, 2, 5, 4)  # s = 2 t1 + t0, d = 16 d1 + d0
            layers.append(LayerTensors("attn", axes, (k, v)))
        return EngineGeometry.from_tensors(model, tp=1, layers=layers)

    want = EngineGeometry.build(model, tp=1, kernel_block_tokens=bs, num_blocks=nb, layout="CPU_ATTN", cpu_isa="amx")
    got = read("page head token1 d1 token0 d0")
    assert got.groups == want.groups and got.regions == want.regions
    swapped = read("page head token0 d1 token1 d0")
    assert swapped.groups != want.groups
    with pytest.raises(GeometryError, match="token axis and token parts") as e:
        read("page head token d1 token0 d0")
    assert e.value.path.endswith(".token")
    with pytest.raises(GeometryError, match="are not token0 .. token1"):
        read("page head token2 d1 token0 d0")


def test_from_tensors_reads_the_legacy_x_split_k_cache() -> None:
    """vLLM's legacy K cache [blocks, heads, head_dim/x, bs, x] (x = 16 bytes) beside a plain V cache
    reads as a per-plane layout with split K vectors (byte modes (16, 1), (16, 256) for 64 float32
    elements at block 16), and plans against CPU_ATTN pages byte-exactly (the simulator)."""
    torch = pytest.importorskip("torch")
    from kvgeom.values.tensors import LayerTensors

    hd, h, nb, bs, x = 64, 4, 8, 16, 4
    model = _model(hd=hd, heads=h)

    def layer() -> LayerTensors:
        k = torch.zeros(nb, h, hd // x, bs, x)
        v = torch.zeros(nb, h, bs, hd).view(nb, h, bs, hd // x, x).permute(0, 1, 3, 2, 4)
        return LayerTensors("attn", "page head d1 token d0", (k, v))

    e = EngineGeometry.from_tensors(model, tp=1, layers=[layer(), layer()])
    lay = e.groups[0].layout
    assert isinstance(lay, PlanesLayout)
    assert lay.planes[0].vector_modes == ((16, 1), (16, 256)) and lay.planes[0].token_modes == ((16, 16),)
    assert lay.planes[1].vector_modes == () and lay.planes[1].token_modes == ((16, 256),)
    pair = Pair(_engine(32), e)
    req = fresh_request(pair, 70)
    assert simulate(pair, req, pair.plan(req)).ok


@pytest.mark.parametrize("bp,bd,d_tp,isa", [(a, b, t, i) for a in SIZES for b in SIZES for t in (1, 2)
                                              for i in ("vec", "amx") if i == "vec" or a != b])
def test_packed_plans_cpu_attn_pairs(bp: int, bd: int, d_tp: int, isa: str) -> None:
    """Packed plans gather through P's per-plane mapping and scatter through D's (docs/design.md §12.2),
    in one chunk and in chunks of a few tokens; the simulator checks every D byte with its own
    address tables."""
    from kvgeom.planning import estimate_packed
    from kvgeom.planning.budget import estimate_plan, quick_estimate
    from kvgeom.planning.packed import min_staging_bytes
    from kvgeom.values.request import RequestShape

    pair = Pair(_engine(bp, isa=isa), _engine(bd, tp=d_tp, isa=isa))
    for M, S in ((150, 0), (150, bd), (33, 0)):
        req = fresh_request(pair, M, prefix_hit_tokens=S, prefill_first_block=1, decode_first_block=2)
        for staging in (1 << 30, 3 * min_staging_bytes(pair, req) + 1):
            plan = plan_reference(pair, req, strategy="packed", staging_bytes=staging)
            assert plan.packed and len(plan.wire) > 0
            rep = simulate(pair, req, plan)
            assert rep.ok, (M, S, staging, str(rep)[:2000])
            steps = plan.packs + plan.unpacks  # the budget's estimates bound the real plan (§14), counted on
            entries = sum(len(x.pages) + len(x.regions) for x in steps)  # windows too
            for refine in (estimate_packed.REFINE_STEPS, 0):
                with pytest.MonkeyPatch.context() as mp:
                    mp.setattr(estimate_packed, "REFINE_STEPS", refine)
                    shape = RequestShape.of(req)
                    for est in (estimate_plan(pair, shape, "packed", staging_bytes=staging),
                                quick_estimate(pair, shape, "packed", staging_bytes=staging)):
                        assert est.chunks >= len(plan.chunks) and est.wire_rows >= len(plan.wire)
                        assert est.staging_steps >= len(steps) and est.staging_entries >= entries


def test_packed_steps_worked_number() -> None:
    """docs/design.md §12.2 (per-plane layouts), by hand: vec, 2 heads of 128 float32 elements, P block 32
    -> D block 64, one layer, 128 tokens. A D block is (head, element, token, byte) densely, so a full D
    page's K unpacks as one 64 * 512 = 32768-byte element per head (head stride 2 * 64 * 512 = 65536 on
    the page), and a P page packs its K as 2 x 128 elements of 32 * 4 = 128 bytes: P strides (head
    2 * 32 * 512 = 32768, element 32 * 4 = 128), staging strides (32768, 64 * 4 = 256); the second P page
    of a D block starts 32 * 4 = 128 bytes in. V keeps token order: 16384 contiguous bytes per head and P
    page. The K plane's blocks take 2 pages x 65536 B, so V's start at 131072."""
    m = ModelSpec("m", (AttentionSpec("attn", "full", 1, 2, 512),), dtype="float32")
    P = EngineGeometry.build(m, tp=1, kernel_block_tokens=32, num_blocks=4, layout="CPU_ATTN", name="P")
    D = EngineGeometry.build(m, tp=1, kernel_block_tokens=64, num_blocks=4, layout="CPU_ATTN", name="D")
    pair = Pair(P, D)
    req = fresh_request(pair, 128, decode_first_block=1)
    plan = plan_reference(pair, req, strategy="packed")

    def step(x: object) -> tuple[object, ...]:
        return (x.offsets.tolist(), x.staged.tolist(), x.pages.tolist(), x.page_staged.tolist(),  # type: ignore[attr-defined]
                x.shape, x.cache_strides, x.staging_strides, x.unit_bytes)  # type: ignore[attr-defined]

    assert [step(x) for x in plan.packs] == [
        ([0], [0], [0, 1, 2, 3], [0, 128, 65536, 65536 + 128], (2, 128), (32768, 128), (32768, 256), 128),
        ([16384], [131072], [0, 1, 2, 3], [0, 16384, 65536, 65536 + 16384], (2,), (32768,), (32768,), 16384)]
    assert [step(x) for x in plan.unpacks] == [
        ([0], [0], [1, 2], [0, 65536], (2,), (65536,), (32768,), 32768),
        ([32768], [131072], [1, 2], [0, 65536], (2,), (65536,), (32768,), 32768)]
    assert plan.wire.nbytes.tolist() == [2 * 2 * 128 * 512] and simulate(pair, req, plan).ok


def test_simulator_catches_packed_steps_that_ignore_per_plane_mappings(monkeypatch: pytest.MonkeyPatch) -> None:
    """Controls: pack and unpack steps that treat head vectors as contiguous (vec K), or that run
    tokens across the amx layout's 16- and 2-token pieces as if one stride held, are caught by the
    simulator's own address tables."""
    import attrs

    from kvgeom.planning import packed_steps, packed_tokens

    pair = Pair(_engine(32), _engine(64))
    req = fresh_request(pair, 100)
    assert simulate(pair, req, plan_reference(pair, req, strategy="packed")).ok
    amx = Pair(_engine(32, isa="amx"), _engine(96, isa="amx"))
    amx_req = fresh_request(amx, 150)
    assert simulate(amx, amx_req, plan_reference(amx, amx_req, strategy="packed")).ok
    with monkeypatch.context() as mp:
        mp.setattr(packed_steps, "vector_unit", lambda spec, sides, plane: (spec.head_bytes, []))
        assert not simulate(pair, req, plan_reference(pair, req, strategy="packed")).ok
    with monkeypatch.context() as mp:
        real = packed_tokens.cuts_of
        mp.setattr(packed_tokens, "cuts_of", lambda *a: attrs.evolve(real(*a), d_cut=0, p_cut=0))
        assert not simulate(amx, amx_req, plan_reference(amx, amx_req, strategy="packed")).ok


def test_compiled_pair_plans_cpu_attn_like_the_reference() -> None:
    """Direct and staged rows equal the reference's; packed (and auto when packed wins, as it does
    here between block sizes) is the reference's packed plan plus the REFERENCE_PATH note (§13.5)."""
    from test_compiled import assert_same

    pair = Pair(_engine(32), _engine(96, tp=2))
    compiled = pair.compile()
    for M, S in ((150, 0), (200, 96), (33, 0), (300, 192)):
        req = fresh_request(pair, M, prefix_hit_tokens=S, prefill_first_block=2, decode_first_block=1)
        for strategy in ("direct", "staged", "auto", "packed"):
            want = plan_reference(pair, req, strategy=strategy)  # type: ignore[arg-type]
            assert_same(compiled.plan(req, strategy=strategy), want)  # type: ignore[arg-type]


def test_drawing_shows_cpu_attn_sources_as_for_plain_pages() -> None:
    """The drawing maps every D coordinate back through the plan with the model's own addresses, so
    a CPU_ATTN pair draws the same cells (which P block, which rank, what is zeroed) as an HND pair
    with the same listings: the source of a token does not depend on where a page keeps it."""
    from kvgeom.show.cells import transfer_cells

    def cells(layout: str) -> list[tuple[str, list[int], list[float]]]:
        P = EngineGeometry.build(_model(), tp=1, kernel_block_tokens=32, num_blocks=12, layout=layout)  # type: ignore[arg-type]
        D = EngineGeometry.build(_model(), tp=2, kernel_block_tokens=64, num_blocks=12, layout=layout)  # type: ignore[arg-type]
        pair = Pair(P, D)
        req = fresh_request(pair, 150, prefill_first_block=3, decode_first_block=1)
        cm = transfer_cells(plan_reference(pair, req), pair, req, rank=1)
        return [(r.label, r.codes.tolist(), r.zero_fraction.tolist()) for r in cm.rows]

    got, want = cells("CPU_ATTN"), cells("HND")
    assert got == want and len(want) > 0


def test_strategies_draw_per_plane_layouts() -> None:
    """The hypothesis strategies reach per-plane layouts with tiled token axes and split head
    vectors on either side (so the fuzzer and the property tests cover §3.5)."""
    from hypothesis import HealthCheck, Phase, find, settings

    from kvgeom.tools import strategies as kst

    reach = settings(max_examples=2000, database=None, phases=[Phase.generate], suppress_health_check=list(HealthCheck))

    def planes(e: EngineGeometry) -> list[PlanesLayout]:
        return [g.layout for g in e.groups if isinstance(g, AttentionGroupGeometry) and isinstance(g.layout, PlanesLayout)]

    for side in ("prefill", "decode"):
        def tiled_and_split(gp: object, side: str = side) -> bool:
            lays = planes(getattr(gp, side))
            return any(len(p.token_modes) > 1 for x in lays for p in x.planes) and any(
                p.vector_modes for x in lays for p in x.planes)
        find(kst.pairs(mismatch_probability=0.0), tiled_and_split, settings=reach)

    def packed_tiled_in_chunks(t: object) -> bool:  # the packed property tests' draws reach them too
        from kvgeom import plan_transfer

        lays = planes(t.pair.prefill) + planes(t.pair.decode)  # type: ignore[attr-defined]
        if not any(len(p.token_modes) > 1 for x in lays for p in x.planes):
            return False
        plan = plan_transfer(*t.pair, t.request, strategy="packed", staging_bytes=t.staging_bytes,  # type: ignore[attr-defined]
                             budget=None)
        return len(plan.chunks) > 1
    find(kst.packed_transfers(transfers=kst.transfers(pairs=kst.pairs(mismatch_probability=0.0))),
         packed_tiled_in_chunks, settings=reach)

    def k_and_v_differ(gp: object) -> bool:
        return any((x.planes[0].token_modes, x.planes[0].vector_modes) != (x.planes[1].token_modes, x.planes[1].vector_modes)
                   for x in planes(gp.decode) if len(x.planes) == 2)  # type: ignore[attr-defined]
    find(kst.pairs(mismatch_probability=0.0), k_and_v_differ, settings=reach)


def test_pair_files_refuse_bad_plane_documents() -> None:
    from kvgeom.errors import SchemaError

    text = dumps(Pair(_engine(64), _engine(32)))
    for bad, path in (('"token_modes":[[64,4]]', '"token_modes":[[64]]'),
                      ('"token_modes":[[64,4]]', '"token_modes":[[64,"4"]]'),
                      ('"vector_modes":[[4,1],[64,256]]', '"vector_modes":[[4,1],[64,-256]]'),
                      ('"token_modes":[[64,4]]', '"token_modes":[[32,4]]')):
        assert bad in text, bad
        with pytest.raises(SchemaError):
            loads(text.replace(bad, path, 1))
