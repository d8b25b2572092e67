"""The connector's reading of bfloat16 (amx) attention pages and of mamba state pages, without vLLM
(docs/design.md §15.3; the end-to-end cells are tests/test_vllm_e2e_hybrid.py).

The oracles are independent of the code under test: kvgeom's builder for CPU_ATTN's amx page
(``EngineGeometry.build(layout="CPU_ATTN", cpu_isa="amx")``), and bytes written by hand into a raw
state page for the mamba unpacking.
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from kvgeom import AttentionSpec, EngineGeometry, ModelSpec, StateSection, StateSpec  # noqa: E402
from kvgeom_nixl.errors import ExecutorError  # noqa: E402
from kvgeom_nixl.vllm.caches import CacheGroup, geometry_from_kv_caches, mamba_state_views  # noqa: E402

HEADS, DIM, LAYERS, BLOCKS = 2, 64, 2, 5


def attention(block: int, isa: str) -> tuple[dict[str, object], CacheGroup]:
    names = tuple(f"layer.{i}" for i in range(LAYERS))
    buf = torch.zeros(LAYERS, BLOCKS, HEADS, block, 2 * DIM, dtype=torch.bfloat16)
    kv = {n: buf[i] for i, n in enumerate(names)}
    return kv, CacheGroup("g0", "full", names, block, HEADS, None, {n: "CPU_ATTN" for n in names},
                          {n: isa for n in names})


@pytest.mark.parametrize("block", [32, 64, 128])
def test_amx_pages_read_as_kvgeom_builds_them(block: int) -> None:
    """bfloat16 CPU_ATTN pages with vLLM's amx kernel read as the builder's amx page; the same
    tensors read as vec pages (K transposed, V in token order) are another geometry (the control)."""
    model = ModelSpec("vllm", [AttentionSpec("g0", "full", num_layers=LAYERS, num_kv_heads=HEADS,
                                             head_bytes=DIM * 2)], dtype="bfloat16")
    want = EngineGeometry.build(model, tp=1, kernel_block_tokens=block, num_blocks=BLOCKS, layout="CPU_ATTN",
                                cpu_isa="amx", name="e")
    kv, group = attention(block, "amx")
    geo, _ = geometry_from_kv_caches(kv, [group], tp=1, name="e")
    assert geo.groups == want.groups and geo.regions == want.regions
    kv, group = attention(block, "vec")
    control, _ = geometry_from_kv_caches(kv, [group], tp=1, name="e")
    assert control.groups != want.groups


def test_mamba_state_views_cut_the_page_as_written_by_hand() -> None:
    """A raw state page [blocks, 1, 1, bytes] holding, per block, a float32 conv state (6, 3) and then
    a float32 temporal state (2, 4, 5), written with numpy at the byte offsets the layout implies."""
    blocks, conv, temporal = 3, (6, 3), (2, 4, 5)
    page = 4 * (18 + 40) + 24  # padded, as vLLM pads a state page to the attention page
    raw = np.zeros((blocks, page), np.uint8)
    want_conv = np.arange(blocks * 18, dtype=np.float32).reshape(blocks, *conv)
    want_ssm = -np.arange(blocks * 40, dtype=np.float32).reshape(blocks, *temporal)
    for b in range(blocks):
        raw[b, :72] = np.frombuffer(want_conv[b].tobytes(), np.uint8)
        raw[b, 72:232] = np.frombuffer(want_ssm[b].tobytes(), np.uint8)
    cache = torch.from_numpy(raw.view(np.int8)).view(blocks, 1, 1, page)
    got_conv, got_ssm = mamba_state_views(cache, [conv, temporal], [torch.float32, torch.float32])
    assert np.array_equal(got_conv.numpy(), want_conv) and np.array_equal(got_ssm.numpy(), want_ssm)
    swapped, _ = mamba_state_views(cache, [temporal, conv], [torch.float32, torch.float32])
    assert swapped.numpy().ravel()[:18].tolist() != want_ssm[0].ravel()[:18].tolist()  # (control)
    with pytest.raises(ExecutorError, match="need more than"):
        mamba_state_views(cache, [conv, (2, 4, 50)], [torch.float32, torch.float32])


def test_mamba_groups_need_kvgeoms_state_spec_and_one_state_per_request() -> None:
    kv, attn = attention(64, "amx")
    names = ("m.0",)
    kv["m.0"] = torch.zeros(BLOCKS, 1, 1, 1024, dtype=torch.int8)
    mamba = CacheGroup("g1", "mamba", names, 2048, HEADS, None, {}, {}, ((8, 3), (2, 4, 4)),
                       (torch.float32, torch.float32), "DS", True)
    with pytest.raises(ExecutorError, match="StateSpec"):
        geometry_from_kv_caches(kv, [attn, mamba], tp=1, name="e")
    spec = StateSpec("g1", 1, (StateSection("x", 4, 4, rows=3), StateSection("B", 2, 4, rows=3),
                               StateSection("C", 2, 4, rows=3), StateSection("ssm", 2, 64)))
    model = ModelSpec("vllm", [spec], dtype="bfloat16")
    aligned = CacheGroup(*[getattr(mamba, f) for f in ("name", "kind", "layers", "block_size", "total_kv_heads",
                                                       "window", "backend", "isa", "state_shapes", "state_dtypes",
                                                       "conv_layout")], one_state=False)
    with pytest.raises(ExecutorError, match="mamba_cache_mode"):
        geometry_from_kv_caches(kv, [attn, aligned], tp=1, name="e", model=model)
