"""Hostile input to ``engine_from_vllm_config`` in vLLM 0.32's field set (docs/design.md §10.2, §14).

The same contract as ``tests/test_hostile_engines.py`` holds for ``KVCacheTensor(size, layers,
layer_stride, block_stride, offset, host_resident)``, ``kv_cache_layout`` and the 0.32 spec fields
(``head_size_v = 0``, an enum ``mamba_type``, ``max_tp_shards``, ``UniformTypeKVCacheSpecs``): one
field of a valid config replaced by an extreme int or a wrong type is a typed ``KvGeomError``
(never a ``TypeError``, ``KeyError``, ``IndexError``, ``OverflowError`` or a plain ``ValueError``), its
message formats no integer of more than 64 digits, and the refusal is fast.
"""

from __future__ import annotations

import enum
import random
import re
import sys
import time
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("hypothesis", reason="the fuzzers need the testing extra (hypothesis)")

from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks import hostile  # noqa: E402
from kvgeom import GeometryError, InternalError, KvGeomError  # noqa: E402
from kvgeom.building import engine_from_vllm_config  # noqa: E402

BIG_DIGITS = re.compile(r"\d{65,}")
CEILING_S = 2.0
CELL = (128 + 128) * 2
PAGE = 16 * 4 * CELL


class MambaAttentionBackendEnum(enum.Enum):  # vLLM 0.32's enum, by name
    GDN_ATTN = "vllm.v1.attention.backends.gdn_attn.GDNAttentionBackend"


def attention_config(layout: str = "LBNHC") -> dict[str, Any]:
    names = ["model.layers.0.attn", "model.layers.1.attn"]
    return {"num_blocks": 9, "kv_cache_layout": layout,
            "kv_cache_tensors": [{"size": 2 * 9 * PAGE, "layers": list(names), "layer_stride": 9 * PAGE,
                                  "block_stride": PAGE, "offset": 0, "host_resident": False}],
            "kv_cache_groups": [{"layer_names": list(names), "kv_cache_spec": {
                "type": "FullAttentionSpec", "block_size": 16, "num_kv_heads": 4, "head_size": 128,
                "head_size_v": 128, "dtype": "torch.bfloat16", "max_tp_shards": 8, "kv_quant_mode": 0}}]}


def mla_config() -> dict[str, Any]:
    page = 64 * 1152
    return {"num_blocks": 3, "kv_cache_layout": "LBHNC",
            "kv_cache_tensors": [{"size": 3 * page, "layers": ["l0"], "layer_stride": 3 * page, "block_stride": page,
                                  "offset": 0}],
            "kv_cache_groups": [{"layer_names": ["l0"], "kv_cache_spec": {
                "type": "MLAAttentionSpec", "block_size": 64, "num_kv_heads": 1, "head_size": 576, "head_size_v": 0,
                "dtype": "torch.bfloat16", "cache_dtype_str": "auto"}}]}


def mamba_config() -> dict[str, Any]:
    """One GDN layer of Qwen3-Next on TP2 beside one attention layer, overlaid (1056-token blocks, 66 pages)."""
    page = 66 * 16384
    names = {"attn": ["model.layers.3.attn"], "gdn": ["model.layers.0.linear_attn"]}
    return {"num_blocks": 2, "kv_cache_layout": "LBHNC",
            "kv_cache_tensors": [{"size": 2 * page, "layers": names[k], "layer_stride": 2 * page, "block_stride": page,
                                  "offset": 0} for k in ("attn", "gdn")],
            "kv_cache_groups": [
                {"layer_names": names["attn"], "kv_cache_spec": {
                    "type": "FullAttentionSpec", "block_size": 1056, "num_kv_heads": 1, "head_size": 256,
                    "dtype": "torch.bfloat16"}},
                {"layer_names": names["gdn"], "kv_cache_spec": {
                    "type": "MambaSpec", "block_size": 1056, "shapes": [[4096, 3], [16, 128, 128]],
                    "dtypes": ["bfloat16", "float32"], "mamba_type": MambaAttentionBackendEnum.GDN_ATTN,
                    "page_size_padded": page, "tp_replicated": False}}]}


MAKERS = {"attention": (attention_config, {"tp": 2, "attention_backend": "FLASH_ATTN"}),
          "mla": (mla_config, {"tp": 8, "attention_backend": "FLASHMLA"}),
          "mamba": (mamba_config, {"tp": 2, "attention_backend": "FLASH_ATTN", "kernel_block_size": 16,
                                   "total_num_kv_heads": 2})}


def test_the_valid_configs_are_read() -> None:
    assert engine_from_vllm_config(attention_config(), **MAKERS["attention"][1]).regions[0].page_bytes == PAGE
    assert engine_from_vllm_config(mla_config(), **MAKERS["mla"][1]).regions[0].page_bytes == 64 * 1152
    geo = engine_from_vllm_config(mamba_config(), **MAKERS["mamba"][1])
    assert geo.blocks_per_logical == 66 and len(geo.regions) == 1  # the GDN layer overlays the attention layer


def with_value(doc: Any, path: tuple[Any, ...], value: Any) -> Any:
    node: Any = doc
    for k in path[:-1]:
        node = node[k]
    node[path[-1]] = value
    return doc


@pytest.mark.parametrize("path, bad, where", [
    (("kv_cache_tensors", 0, "layers"), None, "kv_cache_config.kv_cache_tensors[0].layers"),
    (("kv_cache_tensors", 0, "layers"), range(10**12), "kv_cache_config.kv_cache_tensors[0].layers"),
    (("kv_cache_tensors", 0, "layer_stride"), 10**5000, "kv_cache_config.kv_cache_tensors[0].layer_stride"),
    (("kv_cache_tensors", 0, "block_stride"), -1, "kv_cache_config.kv_cache_tensors[0].block_stride"),
    (("kv_cache_tensors", 0, "offset"), "0", "kv_cache_config.kv_cache_tensors[0].offset"),
    (("kv_cache_tensors", 0, "host_resident"), 1, "kv_cache_config.kv_cache_tensors[0].host_resident"),
    (("kv_cache_layout",), 10**100, "kv_cache_config.kv_cache_layout"),
    (("kv_cache_layout",), ["LBHNC"], "kv_cache_config.kv_cache_layout"),
    (("kv_cache_groups", 0, "kv_cache_spec", "max_tp_shards"), 0, "kv_cache_config.kv_cache_groups[0]"
                                                                 ".kv_cache_spec.max_tp_shards"),
], ids=lambda v: hostile._r(v) if not isinstance(v, str) else v)
def test_layered_fields_are_refused_by_name(path: tuple[Any, ...], bad: Any, where: str) -> None:
    t0 = time.perf_counter()
    with pytest.raises(GeometryError) as err:
        engine_from_vllm_config(with_value(attention_config(), path, bad), **MAKERS["attention"][1])
    assert err.value.path == where, str(err.value)[:300]
    assert not BIG_DIGITS.search(str(err.value)) and time.perf_counter() - t0 < CEILING_S


def _case(r: random.Random) -> tuple[Any, dict[str, Any], str]:
    key = r.choice(sorted(MAKERS))
    make, kw = MAKERS[key]
    doc, kw = make(), dict(kw)
    bad = 10**100 if r.random() < 0.1 else hostile.hostile(r)
    if r.random() < 0.25:
        arg = r.choice(("kv_cache_layout", "kernel_block_size", "attention_backend", "total_num_kv_heads", "tp"))
        kw[arg] = bad
        return doc, kw, f"{key}: {arg}={hostile._r(bad)}"
    paths = [p for p, _ in hostile._paths(doc) if p]
    path = r.choice(paths)
    with_value(doc, path, bad)
    return doc, kw, f"{key}: {path}={hostile._r(bad)}"


@settings(max_examples=300, deadline=None, derandomize=True, database=None, suppress_health_check=list(HealthCheck))
@given(st.integers(0, 2**32 - 1))
def test_fuzz_layered_vllm_config(seed: int) -> None:
    doc, kw, label = _case(random.Random(seed))
    t0 = time.perf_counter()
    try:
        engine_from_vllm_config(doc, **kw)
    except KvGeomError as e:
        assert not isinstance(e, InternalError), label
        assert not BIG_DIGITS.search(str(e)), label
    except Exception as e:  # noqa: BLE001 - the point: nothing untyped escapes
        pytest.fail(f"{label}: {type(e).__name__}: {e!s:.200}")
    assert time.perf_counter() - t0 < CEILING_S, label
