"""Registration and handshake: buffers checked against the geometry, payloads validated on receipt."""

from __future__ import annotations

import base64
import json
import os
from typing import Any

import pytest

os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
os.environ.setdefault("UCX_NET_DEVICES", "lo")
from nixl_env import NIXL_API  # noqa: E402

pytest.importorskip(NIXL_API, reason="nixl is not installed (pip install 'kvgeom[nixl]')")
pytest.importorskip("torch", reason="torch is not installed (pip install 'kvgeom[nixl]')")

import numpy as np  # noqa: E402
import torch  # noqa: E402

from kvgeom import (  # noqa: E402
    AttentionSpec,
    EngineGeometry,
    IncompatibleGeometry,
    ModelSpec,
    SchemaError,  # noqa: E402
)
from kvgeom_nixl import (  # noqa: E402
    HANDSHAKE_VERSION,
    Endpoint,
    ExecutorError,
    HandshakeError,
    RegistrationError,
    decode_rank,
    encode_rank,
)
from kvgeom_nixl.local import allocate_caches  # noqa: E402


def _engine(tp: int = 1, head_bytes: int = 64, name: str = "e") -> EngineGeometry:
    # 2 layers of 2 KV heads, one region per layer, 4 pages of K=4 tokens
    m = ModelSpec("m", [AttentionSpec("attn", "full", 2, 2, head_bytes)])
    return EngineGeometry.build(m, tp=tp, kernel_block_tokens=4, num_blocks=4, name=name)


ENGINE = _engine()
PAGE = 2 * 2 * 4 * 64  # planes * heads * tokens * head_bytes = 1024 B; 4 pages -> 4096 B per region


def test_region_size_worked_number() -> None:
    assert [r.nbytes for r in ENGINE.regions] == [4 * PAGE, 4 * PAGE] == [4096, 4096]


def test_registration_checks_buffers_against_the_geometry() -> None:
    ok = [torch.zeros(4096, dtype=torch.uint8), torch.zeros(4096, dtype=torch.uint8)]
    with pytest.raises(RegistrationError, match=r"regions: 1 buffers for an engine with 2 regions"):
        Endpoint(ENGINE, "prefill", 0, ok[:1])
    with pytest.raises(RegistrationError, match=r"regions\[1\]: 4094 B for a region of 4096 B"):
        Endpoint(ENGINE, "prefill", 0, [ok[0], torch.zeros(2047, dtype=torch.int16)])
    strided = torch.zeros(64, 128, dtype=torch.uint8)[:, ::2]  # 4096 B but not contiguous
    with pytest.raises(RegistrationError, match=r"regions\[0\]: tensor of shape \(64, 64\).* has gaps between its elements"):
        Endpoint(ENGINE, "prefill", 0, [strided, ok[1]])
    with pytest.raises(RegistrationError, match="cannot register a list"):
        Endpoint(ENGINE, "prefill", 0, [[1, 2], ok[1]])
    with pytest.raises(RegistrationError, match="a numpy array is host memory, not VRAM"):
        Endpoint(ENGINE, "prefill", 0, [np.zeros(4096, np.uint8), np.zeros(4096, np.uint8)], mem_type="VRAM")
    with pytest.raises(RegistrationError, match="a cpu tensor is DRAM, not VRAM"):
        Endpoint(ENGINE, "prefill", 0, ok, mem_type="VRAM")
    with pytest.raises(RegistrationError, match="pointer 0 is not a valid address"):
        Endpoint(ENGINE, "prefill", 0, [(0, 4096), ok[1]])
    with pytest.raises(ExecutorError, match="rank 1 outside tp=1"):
        Endpoint(ENGINE, "prefill", 1, ok)
    with pytest.raises(ExecutorError, match="unknown role 'draft'"):
        Endpoint(ENGINE, "draft", 0, ok)


def test_host_pointer_as_vram_is_refused_by_nixl() -> None:
    bufs = [torch.zeros(4096, dtype=torch.uint8) for _ in range(2)]
    if torch.cuda.is_available():
        pytest.skip("a CUDA machine may accept host pointers as VRAM (UVA)")
    with pytest.raises(ExecutorError, match="NIXL refused to register"):
        Endpoint(ENGINE, "prefill", 0, [(b.data_ptr(), 4096) for b in bufs], mem_type="VRAM")


def test_close_releases_everything_and_keeps_tensors() -> None:
    bufs = [torch.zeros(2, 2048, dtype=torch.uint8) for _ in range(2)]
    ep = Endpoint(ENGINE, "decode", 0, bufs)
    assert ep.memory.owners[0] is bufs[0] and ep.memory.owners[1] is bufs[1]
    info = decode_rank(ep.handshake())
    assert [a for a, _, _ in info.regions] == [b.data_ptr() for b in bufs]
    with ep:
        pass
    assert ep.closed and ep.agent is None and ep.memory.regions == ()
    with pytest.raises(ExecutorError, match="is closed"):
        ep.handshake()
    assert bufs[0].is_contiguous() and bufs[0].shape == (2, 2048)


# ---- payloads ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def payload() -> Any:
    caches = allocate_caches(ENGINE)
    ep = Endpoint(ENGINE, "prefill", 0, caches[0])
    yield ep.handshake()
    ep.close()


def test_payload_round_trip(payload: bytes) -> None:
    info = decode_rank(payload)
    assert info.engine == ENGINE and info.role == "prefill" and info.rank == 0
    assert [n for _, n, _ in info.regions] == [4096, 4096] and info.mem_type == "DRAM"
    assert info.metadata and encode_rank(info) == payload
    assert json.loads(payload)["kvgeom_handshake"] == HANDSHAKE_VERSION


def _mut(payload: bytes, fn: Any) -> bytes:
    doc = json.loads(payload)
    fn(doc)
    return json.dumps(doc).encode()


@pytest.mark.parametrize("mutate, path, words", [
    (lambda d: d.update(kvgeom_handshake=1), "$.kvgeom_handshake", "unsupported handshake version 1"),
    (lambda d: d.update(kvgeom_handshake=2), "$.kvgeom_handshake", "unsupported handshake version 2"),
    (lambda d: d.update(kvgeom_handshake=4), "$.kvgeom_handshake", "unsupported handshake version 4"),
    (lambda d: d.pop("secret"), "$.secret", "missing field"),
    (lambda d: d.update(secret="c2hvcnQ="), "$.secret", "a secret of 5 bytes"),
    (lambda d: d.update(secret="not base64!"), "$.secret", "not valid base64"),
    (lambda d: d.update(secret=7), "$.secret", "expected base64 text of 32 bytes"),
    (lambda d: d.pop("kvgeom_handshake"), "$.kvgeom_handshake", "missing payload version"),
    (lambda d: d.pop("agent"), "$.agent", "missing field"),
    (lambda d: d.update(extra=1), "$.extra", "unknown field"),
    (lambda d: d.update(role="draft"), "$.role", "unknown role"),
    (lambda d: d.update(rank=1), "$.rank", "1 is out of range"),
    (lambda d: d.update(rank="0"), "$.rank", "expected an integer"),
    (lambda d: d["engine"].update(tp=0), "$.engine.tp", "must be >= 1"),
    (lambda d: d["engine"].update(schema=7), "$.engine.schema", "unsupported schema version 7"),
    (lambda d: d["memory"]["regions"].pop(), "$.memory.regions", "1 regions advertised for a geometry with 2"),
    (lambda d: d["memory"]["regions"][1].update(nbytes=4095), "$.memory.regions[1].nbytes",
     "4095 B advertised for a region of 4 x 1024 = 4096 B"),
    (lambda d: d["memory"]["regions"][0].update(addr=0), "$.memory.regions[0].addr", "out of range"),
    (lambda d: d["memory"]["regions"][0].update(addr=(1 << 64) - 100), "$.memory.regions[0].addr", "wraps"),
    (lambda d: d["memory"].update(mem_type="FILE"), "$.memory.mem_type", "unknown memory type"),
    (lambda d: d.update(nixl_metadata="not base64!"), "$.nixl_metadata", "not valid base64"),
    (lambda d: d.update(nixl_metadata=""), "$.nixl_metadata", "expected base64"),
])
def test_bad_payloads(payload: bytes, mutate: Any, path: str, words: str) -> None:
    with pytest.raises(HandshakeError) as ei:
        decode_rank(_mut(payload, mutate))
    assert ei.value.path == path, str(ei.value)
    assert words in str(ei.value)
    assert isinstance(ei.value, SchemaError) and isinstance(ei.value, ValueError)


def test_truncated_and_garbage_payloads(payload: bytes) -> None:
    for cut in (0, 1, len(payload) // 3, len(payload) - 1):
        with pytest.raises(HandshakeError, match="malformed or truncated"):
            decode_rank(payload[:cut])
    with pytest.raises(HandshakeError, match="not UTF-8"):
        decode_rank(b"\xff" + payload)
    with pytest.raises(HandshakeError, match="expected a JSON object"):
        decode_rank(b"[]")
    with pytest.raises(HandshakeError, match="expected bytes"):
        decode_rank(12)  # type: ignore[arg-type]


def test_connect_refuses_inconsistent_peers(payload: bytes) -> None:
    d_engine = _engine(tp=1, name="d")
    other = _engine(tp=2, name="p2")
    caches = allocate_caches(d_engine)
    with Endpoint(d_engine, "decode", 0, caches[0]) as d:
        with pytest.raises(HandshakeError, match="a decode rank connects to prefill ranks, got decode"):
            d.connect([_mut(payload, lambda x: x.update(role="decode"))])
        with pytest.raises(HandshakeError, match="rank 0 appears twice"):
            d.connect([payload, payload])
        with pytest.raises(HandshakeError, match="no peer payloads"):
            d.connect([])
        p2 = allocate_caches(other)
        with Endpoint(other, "prefill", 0, p2[0]) as pe:
            with pytest.raises(HandshakeError, match="peer ranks advertise different geometries"):
                d.connect([payload, pe.handshake()])
        # the metadata of another agent under this payload's name
        with Endpoint(ENGINE, "prefill", 0, allocate_caches(ENGINE)[0]) as impostor:
            md = base64.b64encode(impostor.info().metadata).decode()
            with pytest.raises(HandshakeError, match="the NIXL metadata is agent"):
                d.connect([_mut(payload, lambda x: x.update(nixl_metadata=md))])
        # metadata of an agent that is gone: UCX cannot reach it, refused at connect
        with pytest.raises(HandshakeError, match="NIXL refused the metadata"):
            d.connect([_mut(payload, lambda x: x.update(nixl_metadata=md, agent=impostor.name))])
        # an engine with other model facts cannot be paired: refused before any NIXL call
        fp8 = EngineGeometry.build(ModelSpec("m", [AttentionSpec("attn", "full", 2, 2, 32)]), tp=1,
                                   kernel_block_tokens=4, num_blocks=4, name="fp8")
        with Endpoint(fp8, "prefill", 0, allocate_caches(fp8)[0]) as q:
            with pytest.raises(IncompatibleGeometry, match="head_bytes"):
                d.connect([q.handshake()])
        link = d.connect([payload])  # the real one still connects
        assert link.pair.prefill == ENGINE and link.pair.decode == d_engine
