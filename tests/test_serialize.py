"""kvgeom.tools.serialize: round trips of every value class and strict rejection of bad documents."""

from __future__ import annotations

import json
from typing import Any

import attrs
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvgeom import (
    SCHEMA_VERSION,
    AttentionSpec,
    BlockList,
    EngineGeometry,
    GeometryError,
    GroupRequest,
    KvGeomError,
    ModelSpec,
    Pair,
    Region,
    Request,
    SchemaError,
    StateSection,
    StateSlots,
    StateSpec,
    fresh_request,
)
from kvgeom.tools import serialize as S


def _hybrid_model() -> ModelSpec:
    return ModelSpec("hybrid", [
        AttentionSpec("full", "full", 2, 4, 64),
        AttentionSpec("swa", "sliding", 2, 4, 64, window_tokens=32),
        AttentionSpec("mla", "mla", 1, 1, 96),
        StateSpec("mamba", 2, [StateSection("x", 8, 2, rows=3), StateSection("B", 4, 2, rows=3),
                               StateSection("ssm", 4, 64), StateSection("norm", 2, 8, replicated=True)]),
    ], dtype="float16")


def _engines() -> list[EngineGeometry]:
    m = _hybrid_model()
    out = [
        EngineGeometry.build(m, tp=2, kernel_block_tokens=16, num_blocks=12, blocks_per_logical=2, regions="shared",
                             name="p-shared"),
        EngineGeometry.build(m, tp=1, kernel_block_tokens=8, num_blocks=12, blocks_per_logical=4, regions="interleaved",
                             state_layout="state_major", name="d-interleaved"),
        EngineGeometry.build(m, tp=4, kernel_block_tokens=16, num_blocks=3, layout="NHD", kv="split",
                             blocks_per_logical=2, name="d-split"),
        EngineGeometry.build(m, tp=2, kernel_block_tokens=16, num_blocks=3, layout="HND", kv="inner",
                             blocks_per_logical=2, name="inner"),
    ]
    return out


@pytest.mark.parametrize("engine", _engines(), ids=lambda e: e.name)
def test_engine_round_trip(engine: EngineGeometry) -> None:
    text = S.dumps(engine)
    back = S.loads(text)
    assert back == engine
    assert S.dumps(back) == text  # deterministic text
    assert S.from_dict(json.loads(text), expect=EngineGeometry) == engine


def test_every_class_round_trips_through_dicts() -> None:
    m = _hybrid_model()
    e = _engines()[0]
    d = _engines()[1]
    pair = Pair(e, d)
    req = fresh_request(pair, 40, decode_tokens=41, prefix_hit_tokens=0)
    objs: list[Any] = [m, e, pair, req, *m.groups, *e.groups, *e.regions, req.groups[0], req.groups[-1],
                       BlockList((3, 1), 16), StateSlots((2, 5), (10, 20)), m.groups[-1].sections[0]]  # type: ignore[union-attr]
    for obj in objs:
        d_ = S.to_dict(obj)
        assert d_["schema"] == SCHEMA_VERSION and d_["type"] == type(obj).__name__
        json.dumps(d_)  # JSON-able
        assert S.from_dict(d_) == obj, type(obj).__name__


def test_hybrid_request_round_trip_keeps_state_slots() -> None:
    pair = Pair(_engines()[0], _engines()[1])
    req = Request(40, (
        GroupRequest(BlockList((1, 2), 0), BlockList((3,), 0)),
        GroupRequest(BlockList((4,), 32), BlockList((5,), 32)),
        GroupRequest(BlockList((0, 5), 0), BlockList((1,), 0)),
        GroupRequest(StateSlots((6, 7), (32, 40)), StateSlots((4,), (40,))),
    ), partial=True)  # D's attention listings stop at token 32 < M = 40: partial on purpose
    back = S.loads(S.dumps(req))
    assert back == req and back.partial
    assert back.groups[3].decode == StateSlots((4,), (40,))
    pair.check_request(back)
    assert S.loads(S.dumps(attrs.evolve(req, partial=False))).partial is False


def test_region_worked_number() -> None:
    text = S.dumps(Region(4, 8192))
    assert text == '{"num_pages":4,"page_bytes":8192,"schema":1,"type":"Region"}'
    assert len(text) == 60


def test_pair_file_round_trip(tmp_path: Any) -> None:
    pair = Pair(_engines()[0], _engines()[1])
    req = fresh_request(pair, 40, decode_tokens=41)
    f = tmp_path / "pair.json"
    f.write_text(S.dump_pair_file(pair, req))
    p2, r2 = S.load_pair_file(f)
    assert (p2.prefill, p2.decode, r2) == (pair.prefill, pair.decode, req)
    f.write_text(S.dump_pair_file(pair))
    p3, r3 = S.load_pair_file(str(f))
    assert r3 is None and p3.decode == pair.decode


def test_pair_file_hand_written_without_types(tmp_path: Any) -> None:
    """Monomorphic positions may omit "type"; a hand-written file stays short."""
    model = {"name": "m", "groups": [{"type": "AttentionSpec", "name": "a", "kind": "full", "num_layers": 1,
                                      "num_kv_heads": 2, "head_bytes": 16}]}
    engine = {"model": model, "tp": 1, "kernel_block_tokens": 4, "regions": [{"num_pages": 4, "page_bytes": 256}],
              "groups": [{"type": "AttentionGroupGeometry",
                          "layout": {"kv_stride": 128, "head_stride": 64, "token_stride": 16},
                          "views": [{"regions": [0, 0]}]}]}
    doc = {"schema": 1, "prefill": engine, "decode": engine,
           "request": {"computed_tokens": 6, "groups": [{"prefill": {"type": "BlockList", "block_ids": [0, 1]},
                                                         "decode": {"type": "BlockList", "block_ids": [2, 3]}}]}}
    f = tmp_path / "hand.json"
    f.write_text(json.dumps(doc))
    pair, req = S.load_pair_file(f)
    assert pair.prefill.regions == (Region(4, 256),)
    assert req is not None and req.groups[0].decode == BlockList((2, 3), 0)


# ---- rejection -----------------------------------------------------------------------------


def _err(doc: Any, **kw: Any) -> SchemaError:
    with pytest.raises(SchemaError) as ei:
        if isinstance(doc, (str, bytes)):
            S.loads(doc, **kw)
        else:
            S.from_dict(doc, **kw)
    return ei.value


def _engine_doc() -> dict[str, Any]:
    return S.to_dict(_engines()[0])


def test_schema_error_is_a_geometry_error() -> None:
    e = _err("{")
    assert isinstance(e, GeometryError) and isinstance(e, KvGeomError) and isinstance(e, ValueError)


@pytest.mark.parametrize("mutate, path, words", [
    (lambda d: d.pop("schema"), "$.schema", "missing schema"),
    (lambda d: d.update(schema=2), "$.schema", "unsupported schema version 2"),
    (lambda d: d.update(schema="1"), "$.schema", "unsupported"),
    (lambda d: d.pop("type"), "$.type", "missing document type"),
    (lambda d: d.update(type="Banana"), "$.type", "'Banana' is not allowed"),
    (lambda d: d.pop("tp"), "$.tp", "missing field"),
    (lambda d: d.update(tp=True), "$.tp", "expected an integer, got boolean"),
    (lambda d: d.update(tp=2.0), "$.tp", "expected an integer, got number"),
    (lambda d: d.update(tp="2"), "$.tp", "expected an integer, got string"),
    (lambda d: d.update(tp=0), "$.tp", "must be >= 1"),
    (lambda d: d.update(extra=1), "$.extra", "unknown field"),
    (lambda d: d["regions"][1].update(page_bytes=-5), "$.regions[1].page_bytes", "must be >= 1"),
    (lambda d: d["regions"].__setitem__(0, [1, 2]), "$.regions[0]", "expected a JSON object"),
    (lambda d: d["model"]["groups"][0].pop("type"), "$.model.groups[0].type", "one of several types"),
    (lambda d: d["model"]["groups"][0].update(type="Region"), "$.model.groups[0].type", "not allowed here"),
    (lambda d: d["model"]["groups"][0].update(kind="dense"), "$.model.groups[0]", "unknown group kind"),
    (lambda d: d["groups"][3]["views"][0].update(region=99), "$", "views[0].region: region 99 does not exist"),
    (lambda d: d["groups"].pop(), "$", "group geometries for a model with 4 groups"),
    (lambda d: d.update(regions=d["regions"][:1]), "$", "does not exist"),
    (lambda d: d["model"]["groups"][3]["sections"][0].update(replicated=1), "$.model.groups[3].sections[0].replicated",
     "expected true or false"),
])
def test_bad_engine_documents(mutate: Any, path: str, words: str) -> None:
    doc = _engine_doc()
    mutate(doc)
    e = _err(doc)
    assert e.path == path, str(e)
    assert words in str(e), str(e)


def test_truncated_text_always_raises_schema_error() -> None:
    text = S.dumps(_engines()[0])
    for cut in range(0, len(text) - 1, max(1, len(text) // 97)):
        e = _err(text[:cut])
        assert e.path == "$" and "JSON" in e.message, e


def test_bad_text() -> None:
    assert "not UTF-8" in str(_err(b"\xff\xfe{}"))
    assert "expected a JSON object" in str(_err("[1, 2]"))
    assert "malformed" in str(_err('{"schema": 1,, }'))
    assert "truncated" in str(_err('{"schema": 1, "type": "Reg'))
    assert "not allowed" in str(_err(S.dumps(Region(1, 2)), expect=EngineGeometry))


def test_pair_file_errors(tmp_path: Any) -> None:
    e0, e1 = _engines()[0], _engines()[1]
    pair = Pair(e0, e1)
    doc = json.loads(S.dump_pair_file(pair, fresh_request(pair, 40, decode_tokens=41)))
    f = tmp_path / "f.json"

    def load(d: Any) -> SchemaError:
        f.write_text(json.dumps(d) if not isinstance(d, str) else d)
        with pytest.raises(SchemaError) as ei:
            S.load_pair_file(f)
        return ei.value

    assert load({**doc, "decode": None}).path == "$.decode"
    assert load({k: v for k, v in doc.items() if k != "prefill"}).path == "$.prefill"
    assert load({**doc, "schema": 0}).path == "$.schema"
    assert load({**doc, "extra": 1}).path == "$.extra"
    bad_req = json.loads(json.dumps(doc))
    bad_req["request"]["groups"][0]["decode"]["block_ids"] = [999]
    err = load(bad_req)
    assert err.path == "$.request" and "999" in str(err)
    other = S.to_dict(EngineGeometry.build(ModelSpec("x", [AttentionSpec("a", "full", 1, 2, 8)]), tp=1,
                                           kernel_block_tokens=4, num_blocks=2))
    assert "cannot be paired" in str(load({**doc, "decode": other}))
    assert load(S.dump_pair_file(pair)[:50]).path == "$"
    with pytest.raises(SchemaError, match="cannot read"):
        S.load_pair_file(tmp_path / "missing.json")


def test_cannot_serialize_foreign_objects() -> None:
    with pytest.raises(SchemaError, match="cannot serialize a dict"):
        S.to_dict({"a": 1})


# ---- fuzz: any mutation decodes to a valid object or raises SchemaError ----------------------

_LEAVES = st.one_of(st.none(), st.booleans(), st.integers(-3, 1 << 40), st.floats(allow_nan=False),
                    st.text(max_size=5), st.just([]), st.just({}))


def _paths(node: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    out = [prefix]
    if isinstance(node, dict):
        for k, v in node.items():
            out += _paths(v, prefix + (k,))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            out += _paths(v, prefix + (i,))
    return out


_DOC = _engine_doc()
_DOC_PATHS = _paths(_DOC)[1:]


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.tuples(st.sampled_from(_DOC_PATHS), _LEAVES, st.booleans()), min_size=1, max_size=3))
def test_mutated_documents_never_escape_as_other_errors(edits: list[tuple[tuple[Any, ...], Any, bool]]) -> None:
    doc = json.loads(json.dumps(_DOC))
    for path, value, delete in edits:
        node = doc
        try:
            for k in path[:-1]:
                node = node[k]
            if delete and isinstance(node, dict):
                node.pop(path[-1], None)
            else:
                node[path[-1]] = value
        except (KeyError, IndexError, TypeError):
            continue
    try:
        obj = S.from_dict(doc)
    except SchemaError as e:
        assert e.path.startswith("$")
    else:
        assert isinstance(obj, EngineGeometry)
        assert S.from_dict(S.to_dict(obj)) == obj
