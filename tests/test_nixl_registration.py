"""Registering what ``EngineGeometry.from_tensors`` read (issue 20, item 1): the layer tensors
themselves, or the region buffers ``kvgeom_nixl.region_buffers`` finds in them, in region order.
Only :class:`kvgeom_nixl.RankMemory` (no NIXL agent), so it needs torch and not NIXL."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="kvgeom_nixl needs torch")

from kvgeom import AttentionSpec, EngineGeometry, LayerTensors, ModelSpec  # noqa: E402
from kvgeom.values import region_spans  # noqa: E402
from kvgeom_nixl import RankMemory, RegistrationError, region_buffers  # noqa: E402

MODEL = ModelSpec("m", [AttentionSpec("attn", "full", num_layers=2, num_kv_heads=4, head_bytes=256)])


def _flash_hnd() -> tuple[list[torch.Tensor], list[LayerTensors], EngineGeometry]:
    caches = [torch.zeros(2, 8, 4, 16, 128, dtype=torch.bfloat16).permute(0, 1, 3, 2, 4) for _ in range(2)]
    layers = [LayerTensors("attn", "kv page token head dim", c) for c in caches]
    return caches, layers, EngineGeometry.from_tensors(MODEL, tp=1, layers=layers, name="prefill")


def test_region_spans_are_the_k_and_v_planes_in_region_order() -> None:
    caches, layers, engine = _flash_hnd()
    plane = 8 * 16 * 4 * 128 * 2  # 8 pages of 16 tokens x 4 heads x 256 B
    assert [r.nbytes for r in engine.regions] == [plane] * 4
    want = tuple((c[kv].data_ptr(), plane) for c in caches for kv in (0, 1))  # layer 0 K, V, layer 1 K, V
    assert region_spans(MODEL, tp=1, layers=layers, name="prefill") == want


def test_layer_tensors_register_as_views_of_the_same_memory() -> None:
    caches, layers, engine = _flash_hnd()
    bufs = region_buffers(engine, layers)
    assert [(b.dtype, b.numel(), b.data_ptr()) for b in bufs] == \
        [(torch.uint8, r.nbytes, c[kv].data_ptr()) for r, (c, kv) in
         zip(engine.regions, [(c, kv) for c in caches for kv in (0, 1)])]
    bufs[3][:2] = 7  # layer 1's V region, first bytes: the caller's tensor sees it (nothing was copied)
    assert caches[1][1].contiguous().view(torch.uint8).reshape(-1)[:2].tolist() == [7, 7]
    mem = RankMemory(engine, layers)  # what Endpoint(engine, role, rank, layers) registers
    assert [r.addr for r in mem.regions] == [b.data_ptr() for b in bufs]
    assert [r.nbytes for r in mem.regions] == [r.nbytes for r in engine.regions]
    assert mem.mem_type == "DRAM"


def test_k_and_v_planes_register_as_region_buffers() -> None:
    """The issue's second try: the planes are dense (permuted, HND) views, one region each."""
    caches, _, engine = _flash_hnd()
    planes = [c[kv] for c in caches for kv in (0, 1)]
    assert not planes[0].is_contiguous()
    mem = RankMemory(engine, planes)
    assert [r.addr for r in mem.regions] == [p.data_ptr() for p in planes]
    views = mem.byte_views()
    views[0][:1] = 9
    assert int(caches[0][0].contiguous().view(torch.uint8).reshape(-1)[0]) == 9


def test_registration_refuses_gaps_and_other_geometries() -> None:
    caches, layers, engine = _flash_hnd()
    gappy = [c[kv][:, ::2] for c in caches for kv in (0, 1)]  # every other token: not one byte range
    with pytest.raises(RegistrationError) as gaps:
        RankMemory(engine, gappy)
    assert gaps.value.path == "regions[0]" and "LayerTensors" in gaps.value.fix
    other = [LayerTensors("attn", "kv page token head dim", torch.zeros(2, 4, 4, 16, 128, dtype=torch.bfloat16)
                          .permute(0, 1, 3, 2, 4)) for _ in range(2)]  # 4 pages, not 8
    with pytest.raises(RegistrationError) as wrong:
        RankMemory(engine, other)
    assert wrong.value.path == "regions" and "another geometry" in wrong.value.message


def test_numpy_layer_tensors_register_too() -> None:
    arrays = [np.zeros((8, 2, 16, 4, 256), np.uint8) for _ in range(2)]  # FlashInfer NHD, one region per layer
    layers = [LayerTensors("attn", "page kv token head dim", a) for a in arrays]
    engine = EngineGeometry.from_tensors(MODEL, tp=1, layers=layers, name="decode")
    bufs = region_buffers(engine, layers)
    assert [b.ctypes.data for b in bufs] == [a.ctypes.data for a in arrays]
    assert [r.addr for r in RankMemory(engine, layers).regions] == [a.ctypes.data for a in arrays]
