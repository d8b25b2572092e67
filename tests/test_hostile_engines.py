"""Hostile input to the real-engine readers (docs/design.md §10, §14): ``engine_from_vllm_config``
and ``EngineGeometry.from_tensors`` / ``TensorFacts`` / ``LayerTensors``.

Both read what a connector hands over (a vLLM ``KVCacheConfig`` as plain data, tensors or their
facts), so every wrong value must be refused with a typed ``GeometryError`` naming the field, never
a ``TypeError``, ``KeyError``, ``IndexError``, ``OverflowError`` or a plain ``ValueError``, and no
message may format an integer of more than 64 digits. The regressions below are review defects 5
(vLLM configs) and 6 (tensor facts, including an element whose int64 byte count wrapped from
2**64 + 128 B to 128 B and was accepted); the fuzzers mutate one field of a valid call at a time.
"""

from __future__ import annotations

import random
import re
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytest.importorskip("hypothesis", reason="the fuzzers need the testing extra (hypothesis)")

from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks import hostile  # noqa: E402
from kvgeom import AttentionSpec, EngineGeometry, GeometryError, InternalError, KvGeomError, ModelSpec  # noqa: E402
from kvgeom.building import engine_from_vllm_config  # noqa: E402
from kvgeom.values import LayerTensors, TensorFacts  # noqa: E402

BIG_DIGITS = re.compile(r"\d{65,}")
CEILING_S = 2.0  # every refusal here is O(size of the input): well under a millisecond


def _id(value: Any) -> str:
    """A parameter's test id: a function by its name, anything else as hostile._r writes it."""
    return value.__name__ if callable(value) and hasattr(value, "__name__") else hostile._r(value)


def refused(call: Any, error: type[KvGeomError] = GeometryError) -> KvGeomError:
    """The typed error ``call`` raises; its text formats no integer of more than 64 digits."""
    with pytest.raises(error) as info:
        call()
    err = info.value
    assert not isinstance(err, InternalError)
    assert not BIG_DIGITS.search(str(err)), str(err)[:300]
    return err


# ---- vLLM configs -------------------------------------------------------------------------------------

LAYERS = ["model.layers.0.attn", "model.layers.1.attn"]
PAGE = 2 * 16 * 4 * 128 * 2  # K and V, 16 tokens, 4 heads per rank, 128 x bf16


def attention_config() -> dict[str, Any]:
    return {"num_blocks": 9, "kv_cache_tensors": [{"size": PAGE * 9, "shared_by": [n]} for n in LAYERS],
            "kv_cache_groups": [{"layer_names": list(LAYERS), "kv_cache_spec": {
                "type": "FullAttentionSpec", "block_size": 16, "num_kv_heads": 4, "head_size": 128,
                "dtype": "torch.bfloat16"}}]}


def mamba_config() -> dict[str, Any]:
    """One GDN layer of Qwen3-Next on TP2 (docs/design.md §10.2): a 1,073,152 B state per block."""
    return {"num_blocks": 4, "kv_cache_tensors": [{"size": 4 * 1073152, "shared_by": ["model.layers.0.attn"]}],
            "kv_cache_groups": [{"layer_names": ["model.layers.0.attn"], "kv_cache_spec": {
                "type": "MambaSpec", "block_size": 16, "shapes": [[4096, 3], [16, 128, 128]],
                "dtypes": ["bfloat16", "float32"], "mamba_type": "gdn_attention"}}]}


KW: dict[str, Any] = {"tp": 2, "attention_backend": "FLASHINFER"}
SPEC = ("kv_cache_groups", 0, "kv_cache_spec")


def with_value(doc: dict[str, Any], path: tuple[Any, ...], value: Any) -> dict[str, Any]:
    node: Any = doc
    for k in path[:-1]:
        node = node[k]
    node[path[-1]] = value
    return doc


def test_the_valid_configs_are_read() -> None:
    assert engine_from_vllm_config(attention_config(), **KW).regions[0].page_bytes == PAGE
    assert engine_from_vllm_config(mamba_config(), **KW).regions[0].page_bytes == 1073152


CONFIG_CASES = [
    # (config, the field set, its value, the error's path); lists given as None or an int were a TypeError
    *[(make, field, bad, "kv_cache_config." + ".".join(f"{k}" if isinstance(k, str) else f"[{k}]" for k in field)
       .replace(".[", "["))
      for bad in (None, 5)
      for make, field in ((attention_config, ("kv_cache_groups",)), (attention_config, ("kv_cache_tensors",)),
                          (attention_config, ("kv_cache_groups", 0, "layer_names")),
                          (attention_config, ("kv_cache_tensors", 0, "shared_by")),
                          (mamba_config, (*SPEC, "shapes")), (mamba_config, (*SPEC, "dtypes")))],
    (mamba_config, (*SPEC, "shapes", 1), [], "kv_cache_config.kv_cache_groups[0].kv_cache_spec.shapes[1]"),  # IndexError
    (mamba_config, (*SPEC, "shapes"), [[4096, 3]], "kv_cache_config.kv_cache_groups[0].kv_cache_spec.shapes"),
    # numpy arrays: "the truth value of an array is ambiguous" (a plain ValueError)
    *[(attention_config, (*SPEC, key), np.array([1, 2]), f"kv_cache_config.kv_cache_groups[0].kv_cache_spec.{key}")
      for key in ("head_size_v", "kv_quant_mode", "cache_dtype_str")],
    *[(attention_config, ("kv_cache_tensors", 0, key), np.array([0, 1]), f"kv_cache_config.kv_cache_tensors[0].{key}")
      for key in ("offset", "block_stride")],
    # 10**100 printed its 101 digits; 10**5000 made str() raise "Exceeds the limit (4300 digits)"
    *[(make, field, big, "kv_cache_config." + ".".join(f"{k}" if isinstance(k, str) else f"[{k}]" for k in field)
       .replace(".[", "["))
      for big in (10**100, 10**5000)
      for make, field in ((attention_config, (*SPEC, "dtype")), (attention_config, (*SPEC, "head_size_v")),
                          (attention_config, (*SPEC, "cache_dtype_str")),
                          (attention_config, ("kv_cache_groups", 0, "layer_names", 0)),
                          (mamba_config, (*SPEC, "mamba_type")), (mamba_config, (*SPEC, "dtypes", 0)))],
]


@pytest.mark.parametrize(("make", "field", "bad", "path"), CONFIG_CASES, ids=_id)
def test_vllm_config_fields_are_refused_by_name(make: Any, field: tuple[Any, ...], bad: Any, path: str) -> None:
    err = refused(lambda: engine_from_vllm_config(with_value(make(), field, bad), **KW))
    assert err.path == path, str(err)[:300]


@pytest.mark.parametrize(("arg", "bad"), [
    *[(arg, bad) for arg in ("replicated_sections", "group_names") for bad in (5, {"a": 1})],
    ("replicated_sections", None), ("group_names", [10**5000]),
    *[("attention_backend", bad) for bad in (["FLASHINFER"], {"a": 1}, np.array([1, 2]), 10**100, 10**5000)],
    *[(arg, bad) for arg in ("kv_cache_layout", "conv_state_layout") for bad in (np.array([1, 2]), 10**100, 10**5000)],
], ids=_id)
def test_vllm_config_arguments_are_refused_by_name(arg: str, bad: Any) -> None:
    make = mamba_config if arg == "replicated_sections" else attention_config
    err = refused(lambda: engine_from_vllm_config(make(), **{**KW, arg: bad}))
    assert err.path.split("[")[0] == arg, str(err)[:300]


def test_vllm_config_lists_are_bounded_before_they_are_read() -> None:
    t0 = time.perf_counter()
    err = refused(lambda: engine_from_vllm_config({**attention_config(), "kv_cache_groups": range(10**12)}, **KW))
    assert err.path == "kv_cache_config.kv_cache_groups" and "entries exceed" in err.message
    groups = attention_config()["kv_cache_groups"]
    err = refused(lambda: engine_from_vllm_config(with_value(attention_config(), ("kv_cache_groups", 0, "layer_names"),
                                                             range(10**12)), **KW))
    assert err.path == "kv_cache_config.kv_cache_groups[0].layer_names" and groups  # old: list(range(10**12))
    assert time.perf_counter() - t0 < CEILING_S


def _config_case(r: random.Random) -> tuple[Any, str]:
    """One valid config with one field (or argument) replaced by an extreme int or a wrong type."""
    doc = r.choice((attention_config, mamba_config))()
    kw = dict(KW)
    bad = 10**100 if r.random() < 0.1 else hostile.hostile(r)
    if r.random() < 0.3:
        arg = r.choice(("tp", "attention_backend", "kernel_block_size", "kv_cache_layout", "conv_state_layout",
                        "total_num_kv_heads", "replicated_sections", "group_names", "model_name", "name"))
        kw[arg] = bad
        return (doc, kw), f"{arg}={hostile._r(bad)}"
    paths = [p for p, _ in hostile._paths(doc) if p]
    path = r.choice(paths)
    with_value(doc, path, bad)
    return (doc, kw), f"{path}={hostile._r(bad)}"


@settings(max_examples=300, deadline=None, derandomize=True, database=None,
          suppress_health_check=list(HealthCheck))
@given(st.integers(0, 2**32 - 1))
def test_fuzz_vllm_config(seed: int) -> None:
    (doc, kw), label = _config_case(random.Random(seed))
    t0 = time.perf_counter()
    try:
        engine_from_vllm_config(doc, **kw)
    except KvGeomError as e:
        assert not isinstance(e, InternalError), label
        assert not BIG_DIGITS.search(str(e)), label
    except Exception as e:  # noqa: BLE001 - the point: nothing untyped escapes
        pytest.fail(f"{label}: {type(e).__name__}: {e!s:.200}")
    assert time.perf_counter() - t0 < CEILING_S, label


# ---- tensor facts ---------------------------------------------------------------------------------------

MODEL = ModelSpec("m", [AttentionSpec("attn", "full", 1, 4, 256)])
AXES = "kv page token head d1 d2"
GOOD = ((2, 8, 16, 4, 128, 1), (8 * 16384, 16384, 1024, 256, 2, 2), 2, 1 << 30)  # 4 heads of 128 bf16 (256 B)


def from_facts(*facts: Any, **kw: Any) -> EngineGeometry:
    return EngineGeometry.from_tensors(MODEL, **{"tp": 1, "layers": [LayerTensors("attn", AXES, TensorFacts(*facts))],
                                                 **kw})


def test_the_valid_facts_are_read() -> None:
    e = from_facts(*GOOD)
    assert e.regions[0].page_bytes == 16384 and e.groups[0].layout.token_stride == 1024  # type: ignore[union-attr]


def test_an_element_beyond_int64_is_refused_not_wrapped() -> None:
    """2**64 + 128 = 128 x (2**19 + 1) x (2**38 - 2**19 + 1): two element axes within MAX_INT whose
    product, times the 2-byte item, wrapped in int64 to a 256 B head vector the model agreed with."""
    d1, d2 = 128 * (2**19 + 1), 2**38 - 2**19 + 1
    assert d1 * d2 == 2**64 + 128 and max(d1, d2) < 2**48
    facts = ((2, 8, 16, 4, d1, d2), (8 * 16384, 16384, 1024, 256, 2 * d2, 2), 2, 1 << 30)
    err = refused(lambda: from_facts(*facts))
    assert err.path == "engine.attn[0].d1" and err.actual == 2 * (2**64 + 128)
    b = (2**57 + 1) // 3  # the reviewer's form: 384 * b == 2**64 + 128, one dimension beyond MAX_INT
    err = refused(lambda: from_facts((2, 8, 16, 4, 384, b), (8 * 16384, 16384, 1024, 256, 2 * b, 2), 2, 1 << 30))
    assert err.path == "TensorFacts.shape[5]"


@pytest.mark.parametrize(("facts", "path"), [
    (((2, 8, 16, 4, 2**64, 1), GOOD[1], 2, 1 << 30), "TensorFacts.shape[4]"),  # OverflowError
    (((2, None, 16, 4, 128, 1), GOOD[1], 2, 1 << 30), "TensorFacts.shape[1]"),  # TypeError
    (((2, "8", 16, 4, 128, 1), GOOD[1], 2, 1 << 30), "TensorFacts.shape[1]"),
    ((GOOD[0], (8 * 16384, "a", 1024, 256, 2, 2), 2, 1 << 30), "TensorFacts.strides[1]"),
    ((GOOD[0], (8 * 16384, None, 1024, 256, 2, 2), 2, 1 << 30), "TensorFacts.strides[1]"),
    ((None, GOOD[1], 2, 1 << 30), "TensorFacts.shape"),
    ((GOOD[0], None, 2, 1 << 30), "TensorFacts.strides"),
    ((GOOD[0], GOOD[1][:-1], 2, 1 << 30), "TensorFacts.strides"),
    ((*GOOD[:3], -1), "TensorFacts.address"),  # accepted
    ((*GOOD[:3], 2**200), "TensorFacts.address"),  # accepted
    ((*GOOD[:3], 1 << 30, (-1, 10)), "TensorFacts.allocation[0]"),
], ids=_id)
def test_tensor_facts_are_checked_when_built(facts: tuple[Any, ...], path: str) -> None:
    assert refused(lambda: TensorFacts(*facts)).path == path


@pytest.mark.parametrize(("kw", "path"), [
    ({"layers": None}, "engine.layers"),
    ({"regions": 5}, "engine.regions"),
    ({"regions": [(-1, 4096)]}, "engine.regions[0].address"),
    ({"regions": [(2**200, 4096)]}, "engine.regions[0].address"),
    ({"sizes": 5}, "engine.sizes"),
    ({"sizes": {"token": None}}, "engine.sizes['token']"),
    ({"tp": np.array([1, 2])}, "engine.tp"),
    ({"name": 10**5000}, "name"),
], ids=_id)
def test_from_tensors_arguments_are_refused_by_name(kw: dict[str, Any], path: str) -> None:
    assert refused(lambda: from_facts(*GOOD, **kw)).path == path


def test_layer_tensors_fields_are_checked_when_built() -> None:
    facts = TensorFacts(*GOOD)
    assert refused(lambda: LayerTensors(["attn"], AXES, facts)).path == "LayerTensors.group"  # was unhashable
    assert refused(lambda: LayerTensors("attn", 5, facts)).path == "LayerTensors.axes"
    assert refused(lambda: LayerTensors("attn", AXES, facts, name=10**5000)).path == "LayerTensors.name"


def _tensor_case(r: random.Random) -> tuple[Any, str]:
    """The valid facts call with one field, one item of shape or strides, or one argument made hostile."""
    shape, strides, itemsize, address = list(GOOD[0]), list(GOOD[1]), GOOD[2], GOOD[3]
    facts: list[Any] = [shape, strides, itemsize, address, None]
    entry: list[Any] = ["attn", AXES, None, ""]
    kw: dict[str, Any] = {"tp": 1}
    bad = 10**100 if r.random() < 0.1 else hostile.hostile(r)
    what = r.choice(("shape", "strides", "fact", "entry", "arg"))
    if what in ("shape", "strides"):
        i = r.randrange(len(shape))
        (shape if what == "shape" else strides)[i] = bad
        label = f"{what}[{i}]"
    elif what == "fact":
        i = r.randrange(len(facts))
        facts[i] = bad
        label = ("shape", "strides", "itemsize", "address", "allocation")[i]
    elif what == "entry":
        i = r.choice((0, 1, 2, 3))
        entry[i] = bad
        label = ("group", "axes", "tensors", "name")[i]
    else:
        label = r.choice(("tp", "layers", "kernel_block_tokens", "blocks_per_logical", "regions", "sizes",
                          "state_layout", "name"))
        kw[label] = bad

    def call() -> Any:
        if entry[2] is None:
            entry[2] = TensorFacts(*facts)
        if "layers" not in kw:
            kw["layers"] = [LayerTensors(*entry[:3], name=entry[3])]
        return EngineGeometry.from_tensors(MODEL, **kw)

    return call, f"{label}={hostile._r(bad)}"


@settings(max_examples=300, deadline=None, derandomize=True, database=None,
          suppress_health_check=list(HealthCheck))
@given(st.integers(0, 2**32 - 1))
def test_fuzz_from_tensors(seed: int) -> None:
    call, label = _tensor_case(random.Random(seed))
    t0 = time.perf_counter()
    try:
        call()
    except KvGeomError as e:
        assert not isinstance(e, InternalError), label
        assert not BIG_DIGITS.search(str(e)), label
    except Exception as e:  # noqa: BLE001 - the point: nothing untyped escapes
        pytest.fail(f"{label}: {type(e).__name__}: {e!s:.200}")
    assert time.perf_counter() - t0 < CEILING_S, label
