"""The parts of ``KvgeomConnector`` that run without vLLM: its side channel, its geometry reader, its
block rounding (docs/design.md §15.3), checked against hand arithmetic and hostile peers.

The end-to-end cells are tests/vllm_e2e_cells.py (real vLLM; not collected yet); these pin the pieces it is made of.
"""

from __future__ import annotations

import socket
import struct

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("nixl._api", reason="kvgeom_nixl needs the nixl extra")

from kvgeom import AttentionGroupGeometry, PageLayout, Region  # noqa: E402
from kvgeom_nixl.errors import ExecutorError  # noqa: E402
from kvgeom_nixl.vllm.side_channel import (  # noqa: E402
    MAX_FRAME,
    SideChannelError,
    SideChannelServer,
    fetch_handshake,
    send_release,
)
from kvgeom_nixl.vllm.worker import engine_from_kv_caches, whole_blocks  # noqa: E402


def cpu_attn_caches(layers: int = 2, blocks: int = 10, heads: int = 4, block: int = 32, dim: int = 32) -> dict:
    """What vLLM's CPU worker registers: one allocation, each layer a consecutive [B, H, bs, 2*hd] view."""
    per = blocks * heads * block * 2 * dim
    buf = torch.zeros(layers * per)
    return {f"model.layers.{i}.self_attn.attn": buf[i * per:(i + 1) * per].view(blocks, heads, block, 2 * dim)
            for i in range(layers)}


def test_geometry_from_cpu_attn_tensors_is_hand_arithmetic() -> None:
    geo, tensors = engine_from_kv_caches(cpu_attn_caches(), block_size=32, tp=2, total_kv_heads=8, window=None,
                                         name="d")
    # per rank: 4 heads; one (block, head) chunk is K then V, each 32 tokens x 32 float32 = 4096 B
    assert geo.regions == (Region(10, 4 * 2 * 4096),) * 2
    g = geo.groups[0]
    assert isinstance(g, AttentionGroupGeometry)
    assert g.layout == PageLayout(kv_stride=4096, head_stride=8192, token_stride=128)
    assert geo.kernel_block_tokens == 32 and geo.tp == 2 and len(tensors) == 2


def test_blocks_above_32_and_sliding_windows_are_refused_by_name() -> None:
    with pytest.raises(ExecutorError, match="block_size"):
        engine_from_kv_caches(cpu_attn_caches(block=64), block_size=64, tp=1, total_kv_heads=4, window=None, name="p")
    with pytest.raises(ExecutorError, match="sliding_window"):
        engine_from_kv_caches(cpu_attn_caches(), block_size=32, tp=1, total_kv_heads=4, window=128, name="p")
    bad = {"l0": torch.zeros(10, 4, 32, 33)}
    with pytest.raises(ExecutorError, match="kv_caches"):
        engine_from_kv_caches(bad, block_size=32, tp=1, total_kv_heads=4, window=None, name="p")


@pytest.mark.parametrize("tokens, block, want", [(100, 32, 128), (96, 32, 96), (1, 32, 32), (517, 32, 544)])
def test_whole_blocks(tokens: int, block: int, want: int) -> None:
    assert whole_blocks(tokens, block) == want


@pytest.fixture
def server() -> SideChannelServer:
    s = SideChannelServer("127.0.0.1", 0, b"payload-bytes\x00\xff")
    yield s
    s.close()


def test_handshake_payload_round_trips(server: SideChannelServer) -> None:
    host, port = server.address
    assert fetch_handshake(host, port) == b"payload-bytes\x00\xff"


def test_a_request_is_released_once_every_d_rank_said_so(server: SideChannelServer) -> None:
    host, port = server.address
    send_release(host, port, "req-1", d_rank=1, d_tp=2)
    assert not server.released("req-1")  # one of two D ranks
    send_release(host, port, "req-1", d_rank=1, d_tp=2)  # the same rank twice counts once
    assert not server.released("req-1")
    send_release(host, port, "req-1", d_rank=0, d_tp=2)
    assert server.released("req-1")
    assert not server.released("req-1") and server.pending() == 0  # forgotten once reported


def _raw(port: int, data: bytes) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        s.sendall(data)
        s.shutdown(socket.SHUT_WR)
        return s.recv(4096)


@pytest.mark.parametrize("frame", [
    struct.pack("!I", MAX_FRAME + 1),  # a length beyond the limit
    struct.pack("!I", 5) + b"nope!",  # not JSON
    struct.pack("!I", 2) + b"[]",  # not an object
])
def test_hostile_frames_are_refused_and_the_server_keeps_serving(server: SideChannelServer, frame: bytes) -> None:
    host, port = server.address
    assert b"error" in _raw(port, frame)
    assert fetch_handshake(host, port) == b"payload-bytes\x00\xff"


@pytest.mark.parametrize("msg, field", [
    ({"request": "r", "d_rank": 2, "d_tp": 2}, "d_rank"),
    ({"request": "r", "d_rank": 0, "d_tp": True}, "d_tp"),
    ({"request": "", "d_rank": 0, "d_tp": 1}, "release.request"),
    ({"request": "r" * 600, "d_rank": 0, "d_tp": 1}, "release.request"),
])
def test_hostile_releases_are_refused_by_field(server: SideChannelServer, msg: dict, field: str) -> None:
    host, port = server.address
    with pytest.raises(SideChannelError, match=field):
        send_release(host, port, msg["request"], msg["d_rank"], msg["d_tp"])
    assert server.pending() == 0


def test_an_unreachable_p_is_a_side_channel_error() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # bound, not listening: refused
        with pytest.raises(SideChannelError, match="unreachable"):
            fetch_handshake("127.0.0.1", port, timeout_s=2)


def test_a_taken_port_is_refused_by_name(server: SideChannelServer) -> None:
    with pytest.raises(SideChannelError, match="KVGEOM_SIDE_CHANNEL_PORT"):
        SideChannelServer("127.0.0.1", server.address[1], b"x")
