"""The parts of ``KvgeomConnector`` that run without vLLM (docs/design.md §15): the geometry read from
CPU_ATTN's registered tensors, the side channel, and the executor (two endpoints per rank, its threads,
holds, releases, leases, failures) moving real bytes through NIXL between ranks of this process.

Bytes are checked against CPU_ATTN's page written out by hand (an independent address formula, not
the connector's views): per (block b, head h), K element d of slot s at ``d * bs + s`` and V at
``bs * hd + s * hd + d`` of the head's ``2 * bs * hd`` elements (docs/design.md §3.5). The
end-to-end cells on real vLLM are tests/test_vllm_e2e.py.
"""

from __future__ import annotations

import socket
import struct
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")
from nixl_env import NIXL_API  # noqa: E402

pytest.importorskip(NIXL_API, reason="kvgeom_nixl needs the nixl extra")

from kvgeom import EngineGeometry, Pair  # noqa: E402
from kvgeom_nixl.errors import ExecutorError  # noqa: E402
from kvgeom_nixl.testing import free_ports  # noqa: E402
from kvgeom_nixl.vllm.caches import CacheGroup, geometry_from_kv_caches  # noqa: E402
from kvgeom_nixl.vllm.executor import ConnectorExecutor, PullJob, ReleaseJob, Results, whole_pages  # noqa: E402
from kvgeom_nixl.vllm.side_channel import (  # noqa: E402
    MAX_FRAME,
    SideChannelError,
    SideChannelServer,
    exchange_handshake,
    send_release,
)

HEADS, DIM, LAYERS = 4, 32, 2  # the e2e models' KV heads and head_dim; float32


def caches(block: int, tp: int, blocks: int = 24, fill: float | None = None, seed: int = 0) -> dict[str, Any]:
    """What vLLM's CPU worker registers for one rank: one allocation, each layer a [B, H, bs, 2*hd] view."""
    heads = HEADS // tp
    per = blocks * heads * block * 2 * DIM
    if fill is None:
        buf = torch.randn(LAYERS * per, generator=torch.Generator().manual_seed(seed))
    else:
        buf = torch.full((LAYERS * per,), fill)
    return {f"model.layers.{i}.self_attn.attn": buf[i * per:(i + 1) * per].view(blocks, heads, block, 2 * DIM)
            for i in range(LAYERS)}


def group(block: int, window: int | None = None, backend: str = "CPU_ATTN", isa: str = "vec") -> CacheGroup:
    names = tuple(f"model.layers.{i}.self_attn.attn" for i in range(LAYERS))
    return CacheGroup("g0", "sliding" if window else "full", names, block, HEADS, window,
                      {n: backend for n in names}, {n: isa for n in names})


def kv_at(cache: Any, block_id: int, slot: int, head: int) -> tuple[np.ndarray, np.ndarray]:
    """K and V of (block, slot, local head) by CPU_ATTN's byte formula on the flat layer buffer."""
    blocks, heads, bs, two = cache.shape
    hd = two // 2
    flat = cache.reshape(-1).numpy()
    base = (block_id * heads + head) * 2 * bs * hd
    k = flat[base + np.arange(hd) * bs + slot]
    v = flat[base + bs * hd + slot * hd + np.arange(hd)]
    return k, v


# ---- geometry ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("block", [32, 64, 96])
@pytest.mark.parametrize("tp", [1, 2])
def test_geometry_is_the_builders_cpu_attn_layout(block: int, tp: int) -> None:
    from kvgeom import AttentionSpec, ModelSpec

    geo, layers = geometry_from_kv_caches(caches(block, tp, blocks=6, fill=0.0), [group(block)], tp=tp, name="e")
    model = ModelSpec("vllm", [AttentionSpec("g0", "full", num_layers=LAYERS, num_kv_heads=HEADS, head_bytes=DIM * 4)],
                      dtype="float32")
    want = EngineGeometry.build(model, tp=tp, kernel_block_tokens=block, num_blocks=6, layout="CPU_ATTN", name="e")
    assert geo == want and len(layers) == LAYERS
    # one page = this rank's heads x (K + V) x block x 32 float32, by hand
    assert geo.regions[0].page_bytes == HEADS // tp * 2 * block * DIM * 4


def test_what_the_connector_cannot_read_is_refused_by_name() -> None:
    kv = caches(32, 1, blocks=4, fill=0.0)
    with pytest.raises(ExecutorError, match="backend"):
        geometry_from_kv_caches(kv, [group(32, backend="FLASH_ATTN")], tp=1, name="e")
    with pytest.raises(ExecutorError, match="isa"):
        geometry_from_kv_caches(kv, [group(32, isa="neon")], tp=1, name="e")
    bad = {n: torch.zeros(4, 4, 32, 33) for n in kv}
    with pytest.raises(ExecutorError, match="shape"):
        geometry_from_kv_caches(bad, [group(32)], tp=1, name="e")
    with pytest.raises(ExecutorError, match="kind"):
        geometry_from_kv_caches(kv, [CacheGroup("g0", "sliding", tuple(kv), 32, HEADS, None, {}, {})], tp=1, name="e")


# ---- side channel -----------------------------------------------------------------------------------


@pytest.fixture
def server() -> Iterator[SideChannelServer]:
    seen: list[tuple[str, int, int, bytes]] = []

    def on_handshake(engine: str, rank: int, tp: int, payload: bytes) -> None:
        if engine == "refused":
            raise SideChannelError("handshake", "refused on purpose")
        seen.append((engine, rank, tp, payload))

    s = SideChannelServer("127.0.0.1", 0, b"payload-bytes\x00\xff", on_handshake)
    s.seen = seen  # type: ignore[attr-defined]
    yield s
    s.close()


def test_handshake_payloads_cross_both_ways(server: SideChannelServer) -> None:
    host, port = server.address
    assert exchange_handshake(host, port, "D", 1, 2, b"d-payload") == b"payload-bytes\x00\xff"
    assert server.seen == [("D", 1, 2, b"d-payload")]  # type: ignore[attr-defined]
    with pytest.raises(SideChannelError, match="refused on purpose"):
        exchange_handshake(host, port, "refused", 0, 1, b"x")


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
    struct.pack("!I", 36) + b'{"op": "handshake", "engine": "D"}  ',  # no rank, tp, payload
])
def test_hostile_frames_are_refused_and_the_server_keeps_serving(server: SideChannelServer, frame: bytes) -> None:
    host, port = server.address
    assert b"error" in _raw(port, frame)
    assert exchange_handshake(host, port, "D", 0, 1, b"d") == b"payload-bytes\x00\xff"


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


def test_free_ports_are_bindable_and_never_handed_out_twice() -> None:
    bases = [free_ports(3) for _ in range(20)]
    handed = [port for base in bases for port in range(base, base + 3)]
    assert len(set(handed)) == len(handed)  # no port handed out twice in this process
    assert all(20000 <= p < 32000 for p in handed)
    for port in handed[-3:]:  # each one is still bindable (nothing else took it meanwhile)
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))
    with pytest.raises(ExecutorError, match="count"):
        free_ports(0)


def test_an_unreachable_p_is_a_side_channel_error() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # bound, not listening: refused
        with pytest.raises(SideChannelError, match="unreachable"):
            exchange_handshake("127.0.0.1", port, "D", 0, 1, b"x", timeout_s=2)


def test_a_taken_port_is_refused_by_name(server: SideChannelServer) -> None:
    with pytest.raises(SideChannelError, match="KVGEOM_SIDE_CHANNEL_PORT"):
        SideChannelServer("127.0.0.1", server.address[1], b"x")


# ---- the executor, P and D ranks in this process ---------------------------------------------------


class Engines:
    """P and D engines of executors (one per rank), their caches and P's side-channel port."""

    def __init__(self, p_block: int, p_tp: int, d_block: int, d_tp: int, *, lease_s: float = 30.0,
                 pull_timeout_s: float = 30.0, window: int | None = None, eager: bool = False,
                 staging_bytes: int = 0, packed_setup_s: float = 0.0) -> None:
        self.window, self.eager, self.staging_bytes, self.packed_setup_s = window, eager, staging_bytes, packed_setup_s
        self.port = free_ports(p_tp)
        self.p_caches = [caches(p_block, p_tp, seed=10 + r) for r in range(p_tp)]
        self.d_caches = [caches(d_block, d_tp, fill=-7.0) for _ in range(d_tp)]
        self.p_block, self.d_block, self.p_tp, self.d_tp, self.lease_s = p_block, d_block, p_tp, d_tp, lease_s
        self.p = [self._executor(self.p_caches[r], p_block, p_tp, r, "P", producer=True) for r in range(p_tp)]
        self.d = [self._executor(self.d_caches[r], d_block, d_tp, r, "D", producer=False,
                                 pull_timeout_s=pull_timeout_s) for r in range(d_tp)]

    def _executor(self, kv: dict[str, Any], block: int, tp: int, rank: int, engine: str, *, producer: bool,
                  pull_timeout_s: float = 30.0) -> ConnectorExecutor:
        geo, layers = geometry_from_kv_caches(kv, [group(block, self.window)], tp=tp, name=engine)
        return ConnectorExecutor(geo, rank, tp, layers, engine_id=engine, producer=producer, consumer=not producer,
                                 port=self.port + rank if producer else 0, pull_timeout_s=pull_timeout_s,
                                 handshake_timeout_s=30.0, eager=self.eager, staging_bytes=self.staging_bytes,
                                 packed_setup_s=self.packed_setup_s)

    def pull(self, rid: str, tokens: int, p_ids: list[int], d_ids: list[int], *, hit: int = 0,
             port: int | None = None, recomputed: int = 0) -> None:
        for ex in self.p:
            ex.send(rid, self.lease_s)
        release = ReleaseJob(rid, "127.0.0.1", self.port if port is None else port, self.p_tp)
        for ex in self.d:
            ex.pull(PullJob(f"d-{rid}", rid, "P", tokens, hit, (tuple(p_ids),), (tuple(d_ids),), release, recomputed))

    def wait(self, timeout_s: float = 60.0) -> tuple[list[Results], list[Results]]:
        """Until every D rank reported the pull and every P rank the send (or the timeout)."""
        d_out, p_out = [Results() for _ in self.d], [Results() for _ in self.p]
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for acc, ex in [*zip(d_out, self.d), *zip(p_out, self.p)]:
                got = ex.take()
                acc.finished_recving |= got.finished_recving
                acc.finished_sending |= got.finished_sending
                acc.failed.update(got.failed)
            if all(r.finished_recving for r in d_out) and all(r.finished_sending for r in p_out):
                break
            time.sleep(0.01)
        return d_out, p_out

    def close(self) -> None:
        for ex in [*self.d, *self.p]:
            ex.close()


def assert_tokens_equal(e: Engines, tokens: range, p_ids: list[int], d_ids: list[int], d_from: int = 0) -> None:
    """Every listed token's K and V, every layer and global head, on D equal P's (CPU_ATTN by hand)."""
    for layer in range(LAYERS):
        name = f"model.layers.{layer}.self_attn.attn"
        for t in tokens:
            for h in range(HEADS):
                pr, ph = divmod(h, HEADS // e.p_tp)
                dr, dh = divmod(h, HEADS // e.d_tp)
                pk, pv = kv_at(e.p_caches[pr][name], p_ids[t // e.p_block], t % e.p_block, ph)
                dk, dv = kv_at(e.d_caches[dr][name], d_ids[(t - d_from) // e.d_block], (t - d_from) % e.d_block, dh)
                assert np.array_equal(pk, dk) and np.array_equal(pv, dv), f"layer {layer} token {t} head {h}"


@pytest.mark.timeout(300)
@pytest.mark.parametrize("p_block, p_tp, d_block, d_tp, eager", [
    (32, 1, 32, 1, False), (32, 1, 64, 1, False), (64, 1, 32, 1, False), (32, 1, 96, 1, False),
    (128, 1, 32, 1, False), (32, 1, 64, 2, False), (32, 2, 64, 1, False), (32, 2, 32, 1, False),
    (32, 1, 64, 2, True), (32, 2, 64, 1, True), (32, 1, 32, 1, True),  # eager READs (eager_pull: true)
])
def test_a_pull_moves_every_token_byte_exact(p_block: int, p_tp: int, d_block: int, d_tp: int, eager: bool) -> None:
    e = Engines(p_block, p_tp, d_block, d_tp, eager=eager)
    try:
        m = 100  # off every block boundary
        p_ids = list(range(3, 3 + -(-m // p_block)))
        d_ids = list(range(5, 5 + -(-m // d_block)))
        untouched = [kv_at(e.d_caches[0]["model.layers.0.self_attn.attn"], 0, 0, 0)]
        e.pull("r1", m, p_ids, d_ids)
        d_out, p_out = e.wait()
        assert all(r.finished_recving == {"d-r1"} and not r.failed for r in d_out), d_out
        assert all(r.finished_sending == {"r1"} for r in p_out), p_out  # freed on D's release
        assert_tokens_equal(e, range(m), p_ids, d_ids)
        assert all(np.all(x == -7.0) for x in untouched[0])  # block 0 was not listed: untouched
        assert all(ex.pending()["sends"] == 0 and ex.pending()["releases"] == 0 for ex in e.p)
        assert all(ex.pending()["pulls"] == 0 for ex in e.d)
    finally:
        e.close()


def test_full_attention_pulls_plan_whole_pages_windows_do_not() -> None:
    full = {b: geometry_from_kv_caches(caches(b, 1), [group(b)], tp=1, name=f"f{b}")[0] for b in (32, 64)}
    window = geometry_from_kv_caches(caches(32, 1), [group(32, window=64)], tp=1, name="w")[0]
    assert [whole_pages(Pair(full[32], full[32]), m) for m in (1, 100, 128, 129)] == [32, 128, 128, 160]
    assert whole_pages(Pair(full[32], full[64]), 70) == whole_pages(Pair(full[64], full[32]), 70) == 96
    assert whole_pages(Pair(window, window), 100) == 100  # a window ends at M: rounding would move it


@pytest.mark.timeout(300)
def test_the_last_block_moves_as_a_whole_page() -> None:
    """M = 100 at 32 -> 32: D's last block gets P's whole page, slots 100..127 too (rows D overwrites
    or masks); without the rounding those slots keep D's -7.0 (the control below)."""
    e = Engines(32, 1, 32, 1)
    try:
        p_ids, d_ids = [3, 4, 5, 6], [5, 6, 7, 8]
        e.pull("r1", 100, p_ids, d_ids)
        d_out, _ = e.wait()
        assert d_out[0].finished_recving == {"d-r1"} and not d_out[0].failed
        assert_tokens_equal(e, range(128), p_ids, d_ids)
        assert all(np.all(x == -7.0) for x in kv_at(e.d_caches[0]["model.layers.0.self_attn.attn"], 9, 0, 0))
    finally:
        e.close()


@pytest.mark.timeout(300)
@pytest.mark.parametrize("recomputed", [1, 0])
def test_a_window_ends_at_the_token_vllm_recomputes(recomputed: int) -> None:
    """A load reaching the prompt's last token M - 1 is stepped back by vLLM, which recomputes that
    token: it attends keys [M - W, M - 1], so D needs token M - W = 60 (window 40, M = 100), which
    the next token's window [61, 100) would leave out. The control (recomputed 0) shows the check
    fails when the window is taken from M: token 60 is then not moved."""
    e = Engines(32, 1, 64, 1, window=40)
    try:
        m, p_ids, d_ids = 100, [3, 4, 5, 6], [5, 6]
        e.pull("r1", m, p_ids, d_ids, recomputed=recomputed)
        d_out, _ = e.wait()
        assert d_out[0].finished_recving == {"d-r1"} and not d_out[0].failed, d_out
        assert_tokens_equal(e, range(61, 99), p_ids, d_ids)  # both windows hold these
        if recomputed:
            assert_tokens_equal(e, range(60, 61), p_ids, d_ids)
        else:
            with pytest.raises(AssertionError, match="token 60"):
                assert_tokens_equal(e, range(60, 61), p_ids, d_ids)
    finally:
        e.close()


@pytest.mark.timeout(300)
def test_nothing_to_keep_past_the_hit_is_finished_without_a_read() -> None:
    """D holds [0, 64) and vLLM recomputes token 64, the only one loaded (a sliding window: full
    attention would move whole pages): no READ, D's block is not written, the pull is reported
    finished (not failed) and P is released."""
    e = Engines(32, 1, 64, 1, window=40)
    try:
        before = e.d_caches[0]["model.layers.0.self_attn.attn"].clone()
        e.pull("r1", 65, [3, 4, 5], [2], hit=64, recomputed=1)
        d_out, p_out = e.wait()
        assert d_out[0].finished_recving == {"d-r1"} and not d_out[0].failed, d_out
        assert p_out[0].finished_sending == {"r1"}, p_out
        assert torch.equal(before, e.d_caches[0]["model.layers.0.self_attn.attn"])
    finally:
        e.close()


@pytest.mark.timeout(300)
def test_a_prefix_hit_pulls_only_the_rest() -> None:
    """D holds tokens [0, 64) (its block 0 of 64): it pulls [64, 100) from P's 32-token blocks into
    its block 2, and never writes the block it holds."""
    e = Engines(32, 1, 64, 1)
    try:
        p_ids, d_ids = [3, 4, 5, 6], [2]
        held = kv_at(e.d_caches[0]["model.layers.0.self_attn.attn"], 9, 0, 0)
        e.pull("r1", 100, p_ids, d_ids, hit=64)
        d_out, _ = e.wait()
        assert d_out[0].finished_recving == {"d-r1"} and not d_out[0].failed
        assert_tokens_equal(e, range(64, 100), p_ids, d_ids, d_from=64)
        assert all(np.all(x == -7.0) for x in held)
    finally:
        e.close()


@pytest.mark.timeout(300)
def test_an_unreachable_p_fails_the_pull_with_every_listed_block_invalid() -> None:
    e = Engines(32, 1, 32, 1)
    try:
        dead = free_ports(1)  # nothing listens there
        e.pull("r1", 100, [3, 4, 5, 6], [7, 8, 9, 10], port=dead)
        d_out, p_out = e.wait(timeout_s=20)
        assert d_out[0].finished_recving == {"d-r1"}
        assert d_out[0].failed == {"d-r1": {0: {7, 8, 9, 10}}}
        assert not p_out[0].finished_sending  # P never heard of D: it frees on its lease
    finally:
        e.close()


@pytest.mark.timeout(300)
def test_a_p_that_never_holds_times_the_pull_out_and_its_lease_frees_the_blocks() -> None:
    """P does not know the request (no send): D's req waits, the pull times out and fails with its
    blocks invalid; a send registered later expires on its lease."""
    e = Engines(32, 1, 32, 1, lease_s=1.0, pull_timeout_s=2.0)
    try:
        release = ReleaseJob("r1", "127.0.0.1", e.port, 1)
        e.d[0].pull(PullJob("d-r1", "r1", "P", 40, 0, ((3, 4),), ((7, 8),), release))
        d_out, _ = e.wait(timeout_s=0)
        deadline = time.monotonic() + 60
        while not d_out[0].finished_recving and time.monotonic() < deadline:
            got = e.d[0].take()
            d_out[0].finished_recving |= got.finished_recving
            d_out[0].failed.update(got.failed)
            time.sleep(0.05)
        assert d_out[0].failed == {"d-r1": {0: {7, 8}}}
        e.p[0].send("r2", 1.0)  # never pulled: freed when its lease ends
        e.p[0].send("r2", 1.0)  # (a duplicate is ignored)
        deadline = time.monotonic() + 30
        freed: set[str] = set()
        while "r2" not in freed and time.monotonic() < deadline:
            freed |= e.p[0].take().finished_sending
            time.sleep(0.05)
        assert freed == {"r2"}
        e.p[0].send("r2", 1.0)  # vLLM frees a request once: a late duplicate is not held again
        time.sleep(0.3)
        assert e.p[0].pending()["sends"] == 0
    finally:
        e.close()


@pytest.mark.timeout(300)
def test_a_release_after_the_lease_expired_is_dropped_not_kept() -> None:
    """D releases a request P already freed (its lease expired first): P drops the release instead
    of keeping it for the side channel's hour; a release for a request P has not registered yet is
    kept (the scheduler may hand P the send after D's release arrived)."""
    e = Engines(32, 1, 32, 1, lease_s=0.5)
    try:
        p = e.p[0]
        p.send("r1", 0.5)
        deadline = time.monotonic() + 30
        freed: set[str] = set()
        while "r1" not in freed and time.monotonic() < deadline:
            freed |= p.take().finished_sending
            time.sleep(0.05)
        assert freed == {"r1"} and p.counters()["freed lease expired"] == 1
        send_release("127.0.0.1", e.port, "r1", 0, 1)  # D, late
        send_release("127.0.0.1", e.port, "r-not-yet", 0, 1)  # before P registered the send
        deadline = time.monotonic() + 30
        while p.pending()["releases"] != 1 and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.3)  # a few more progress ticks
        assert p.pending()["releases"] == 1, p.counters()  # r-not-yet only
        p.send("r-not-yet", 30.0)
        deadline = time.monotonic() + 30
        while "r-not-yet" not in freed and time.monotonic() < deadline:
            freed |= p.take().finished_sending
            time.sleep(0.05)
        c = p.counters()
        assert "r-not-yet" in freed and c["freed released"] == 1 and c["releases"] == 0, c
        assert all(c[k] == 0 for k in ("sends", "holds", "in_flight", "fencing", "inbox", "unreported")), c
    finally:
        e.close()


@pytest.mark.timeout(300)
def test_a_release_to_a_hung_p_does_not_hold_up_pulls() -> None:
    """A P that accepts connections and never answers (stopped, wedged): D's release to it waits
    for the side channel's timeout (120 s), and D's pulls from another P must not wait behind it."""
    e = Engines(32, 1, 32, 1)
    with socket.socket() as hung:
        hung.bind(("127.0.0.1", 0))
        hung.listen(8)  # the kernel completes connects; nobody ever reads or answers
        try:
            e.d[0].release(ReleaseJob("gone", "127.0.0.1", hung.getsockname()[1], 1))
            time.sleep(0.5)  # the release is under way (connected, waiting for an answer)
            e.pull("r1", 100, [3, 4, 5, 6], [7, 8, 9, 10])
            d_out, p_out = e.wait(timeout_s=45)  # far below the hung release's 120 s
            assert d_out[0].finished_recving == {"d-r1"} and not d_out[0].failed, d_out
            assert p_out[0].finished_sending == {"r1"}, p_out
            assert_tokens_equal(e, range(100), [3, 4, 5, 6], [7, 8, 9, 10])
        finally:
            e.close()


def test_the_eager_pull_switch_takes_json_booleans_only() -> None:
    """``kv_connector_extra_config["eager_pull"]``: absent -> off; true/false as given; anything else
    (the string "false" would read as true) is refused by name with the fix."""
    from kvgeom_nixl.vllm.worker import _flag

    assert _flag({}, "eager_pull", False) is False
    assert _flag({"eager_pull": True}, "eager_pull", False) is True
    for bad in ("true", 1, None):
        with pytest.raises(ExecutorError, match="kv_connector_extra_config.eager_pull") as ei:
            _flag({"eager_pull": bad}, "eager_pull", False)
        assert "JSON boolean" in str(ei.value)
