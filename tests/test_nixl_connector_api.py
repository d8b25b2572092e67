"""The executor as a connector uses it (docs/design.md §8, "The connector loop"): the threading model
(one lock per endpoint, a Progressor thread), kv_both as two endpoints over one instance's tensors,
and the prober started in the background. Real NIXL, in this process."""

from __future__ import annotations

import os
import threading
import time
from typing import Any

import pytest

os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
os.environ.setdefault("UCX_NET_DEVICES", "lo")
from nixl_env import NIXL_API  # noqa: E402

pytest.importorskip(NIXL_API, reason="nixl is not installed (pip install 'kvgeom[nixl]')")
pytest.importorskip("torch", reason="torch is not installed (pip install 'kvgeom[nixl]')")

import torch  # noqa: E402

from kvgeom import AttentionSpec, EngineGeometry, ModelSpec, Pair, fresh_request  # noqa: E402
from kvgeom_nixl import Endpoint, ExecutorError, Progressor  # noqa: E402
from kvgeom_nixl.local import LocalDeployment, allocate_caches, check_caches, fill_caches  # noqa: E402

M = ModelSpec("m", [AttentionSpec("attn", "full", 2, 4, 128)])
PAIR = Pair(EngineGeometry.build(M, tp=2, kernel_block_tokens=16, num_blocks=8, name="prefill"),
            EngineGeometry.build(M, tp=1, kernel_block_tokens=16, num_blocks=8, name="decode"))
REQUEST = fresh_request(PAIR, 50, prefill_first_block=1, decode_first_block=4)


def _deployment() -> tuple[LocalDeployment, list[Any]]:
    p, d = allocate_caches(PAIR.prefill), allocate_caches(PAIR.decode)
    fill_caches(PAIR, REQUEST, p, d)
    return LocalDeployment(PAIR, p, d), d


def _connector_loop(dep: LocalDeployment, n: int, timeout_s: float) -> tuple[set[str], set[str]]:
    """P holds knowing only its own blocks, D pulls; this thread drives only D (get_finished) and
    reads P's ends with get_finished too, never calling P's progress itself."""
    ts = []
    for i in range(n):
        ts += [lk.hold(f"c{i}", timeout_s=timeout_s) for lk in dep.p_links]
        ts.append(dep.d_links[0].pull(f"c{i}", REQUEST, timeout_s=timeout_s))
    done: set[str] = set()
    failed: set[str] = set()
    start = time.perf_counter()
    while len(done) + len(failed) < n * 3 and time.perf_counter() < start + timeout_s + 10:
        if time.perf_counter() > start + timeout_s + 1 and all(t.settled for t in ts if t.role == "decode"):
            break  # (the control: P's holds never end, nobody progresses them)
        for ep in dep.endpoints:
            f = ep.get_finished(progress=ep.role == "decode")  # P: only collect what another thread advanced
            done |= {f"{ep.name}:{i}" for i in f.done_ids}
            failed |= {f"{ep.name}:{i}" for i in f.failed_ids}
        time.sleep(1e-4)
    return done, failed


def test_a_progressor_keeps_an_idle_prefill_rank_answering() -> None:
    """A P rank whose engine is idle (nobody calls its progress) answers D's pulls while a Progressor
    runs; without it every pull waits for P's grant until its deadline (the control)."""
    dep, d_caches = _deployment()
    with dep:
        with Progressor(*dep.p, interval_s=1e-3) as prog:
            done, failed = _connector_loop(dep, 20, timeout_s=30)
        assert not prog.errors and not prog.running
        assert failed == set() and len(done) == 60  # 20 requests x (D rank 0, P rank 0, P rank 1)
        assert check_caches(PAIR, REQUEST, d_caches)[0] == []
        done, failed = _connector_loop(dep, 2, timeout_s=0.5)  # the control: no thread progresses P
        assert done == set() and failed  # nothing completes; D's pulls fail at their deadline


def test_every_call_holds_the_endpoint_lock() -> None:
    """progress() from another thread waits while this thread holds ``endpoint.lock``; the control is
    the same progress without the lock, which does not wait."""
    dep, _ = _deployment()
    with dep:
        ep = dep.d[0]

        def blocked_while_held(progress: Any) -> bool:
            finished = threading.Event()
            with ep.lock:
                th = threading.Thread(target=lambda: (progress(ep), finished.set()), daemon=True)
                th.start()
                waited = not finished.wait(0.2)
            th.join(10)
            return waited and finished.is_set()

        assert blocked_while_held(Endpoint.progress)
        assert not blocked_while_held(Endpoint.progress.__wrapped__)  # type: ignore[attr-defined]
        t = dep.d_links[0].pull("locked", REQUEST, timeout_s=10)
        with ep.lock:
            th = threading.Thread(target=t.cancel, daemon=True)  # a cancel from another thread waits too
            th.start()
            th.join(0.2)
            assert th.is_alive() and not t.settled
        th.join(10)
        assert t.failure is not None and t.failure.reason == "closed"
        with pytest.raises(ExecutorError, match="lock"):
            Endpoint(PAIR.decode, "decode", 0, allocate_caches(PAIR.decode)[0], lock=object(), warm_prober=False)


def test_kv_both_is_two_endpoints_over_one_instances_tensors() -> None:
    """Two instances A and B, each serving and pulling at once: a prefill and a decode endpoint over
    the same tensors per instance (one lock, one Progressor). Request X is prefilled on A and pulled
    by B while request Y goes the other way; each D block must equal its P block (same geometry on
    both sides, 64 tokens = 4 whole blocks: a page-for-page copy, checked by hand)."""
    engine = EngineGeometry.build(M, tp=1, kernel_block_tokens=16, num_blocks=12, name="both")
    pair = Pair(engine, engine)
    request = fresh_request(pair, 64, prefill_first_block=0, decode_first_block=8)  # P blocks 0-3 -> D 8-11
    gen = torch.Generator().manual_seed(19)
    caches = {k: [torch.randint(0, 256, (r.nbytes,), dtype=torch.uint8, generator=gen) for r in engine.regions]
              for k in "AB"}
    page = [r.page_bytes for r in engine.regions]

    def pages(t: torch.Tensor, region: int, first: int) -> torch.Tensor:
        return t[first * page[region]:(first + 4) * page[region]].clone()

    before = {k: [(pages(t, i, 0), pages(t, i, 8)) for i, t in enumerate(caches[k])] for k in "AB"}
    assert all(not torch.equal(a[0], b[1]) for a, b in zip(before["A"], before["B"], strict=True))  # can fail
    inst = {}
    for k in "AB":
        lock = threading.RLock()
        inst[k] = (Endpoint(engine, "prefill", 0, caches[k], lock=lock, warm_prober=False),
                   Endpoint(engine, "decode", 0, caches[k], lock=lock, warm_prober=False))
    try:
        a_p, a_d = inst["A"]
        b_p, b_d = inst["B"]
        to_b, to_a = b_d.connect([a_p.handshake()], probe=False), a_d.connect([b_p.handshake()], probe=False)
        a_serves, b_serves = a_p.connect([b_d.handshake()], probe=False), b_p.connect([a_d.handshake()], probe=False)
        with Progressor(a_p, a_d, b_p, b_d):
            holds = [a_serves.hold("X", timeout_s=20), b_serves.hold("Y", timeout_s=20)]
            pulls = [to_b.pull("X", request, timeout_s=20), to_a.pull("Y", request, timeout_s=20)]
            deadline = time.perf_counter() + 30
            while not all(t.settled for t in holds + pulls):
                time.sleep(1e-3)
                assert time.perf_counter() < deadline
        assert all(t.done for t in holds + pulls), [t.failure for t in holds + pulls]
        for i in range(len(page)):
            assert torch.equal(pages(caches["B"][i], i, 8), before["A"][i][0])  # X: A's blocks 0-3 in B's 8-11
            assert torch.equal(pages(caches["A"][i], i, 8), before["B"][i][0])  # Y: B's blocks 0-3 in A's 8-11
            assert torch.equal(pages(caches["A"][i], i, 0), before["A"][i][0])  # what P serves is only read
    finally:
        for pair_of in inst.values():
            for ep in pair_of:
                ep.close()


def test_an_endpoint_starts_the_prober_in_the_background() -> None:
    """Made with ``warm_prober=True`` (the default), an endpoint starts the process's prober at once,
    so that its first connect does not wait for it (benchmarks/connect.py measures the difference)."""
    from kvgeom_nixl.probe import prober

    caches = allocate_caches(PAIR.decode)
    with Endpoint(PAIR.decode, "decode", 0, caches[0]):
        deadline = time.perf_counter() + 60
        while prober()._proc is None or prober()._proc.poll() is not None:
            time.sleep(0.01)
            assert time.perf_counter() < deadline, "the prober did not start"


def test_a_progressor_needs_endpoints_and_reports_errors() -> None:
    with pytest.raises(ExecutorError, match="at least one endpoint"):
        Progressor()

    class Broken:
        closed = False

        def progress(self) -> None:
            raise RuntimeError("a bug")

    prog = Progressor(Broken(), interval_s=1e-3).start()  # type: ignore[arg-type]
    deadline = time.perf_counter() + 10
    while prog.running:
        time.sleep(1e-3)
        assert time.perf_counter() < deadline
    assert len(prog.errors) == 1 and isinstance(prog.errors[0], RuntimeError)
    prog.stop()


def _filled_pair(tokens: int, decode_first_block: int, **endpoint: Any) -> tuple[Any, Any, Any, Endpoint, Endpoint]:
    """TP1 block-16 P and D of 8 blocks, P's caches filled for a fresh request of ``tokens``:
    (pair, request, D's caches, P's endpoint, D's endpoint), both made with ``endpoint``."""
    pair = Pair(EngineGeometry.build(M, tp=1, kernel_block_tokens=16, num_blocks=8, name="prefill"),
                EngineGeometry.build(M, tp=1, kernel_block_tokens=16, num_blocks=8, name="decode"))
    request = fresh_request(pair, tokens, prefill_first_block=1, decode_first_block=decode_first_block)
    p_caches, d_caches = allocate_caches(pair.prefill), allocate_caches(pair.decode)
    fill_caches(pair, request, p_caches, d_caches)
    return (pair, request, d_caches, Endpoint(pair.prefill, "prefill", 0, p_caches[0], **endpoint),
            Endpoint(pair.decode, "decode", 0, d_caches[0], **endpoint))


@pytest.mark.parametrize("resend_s, completes", [(0.5, True), (60.0, False)])
def test_a_req_p_dropped_before_knowing_d_is_repeated(resend_s: float, completes: bool) -> None:
    """D pulls before P has connected to it: P's inbox drops D's req (``unknown_sender``: no key for
    that agent yet). Once P connects and holds, D's repeated req (every ``resend_s``) is granted and
    the pull lands byte-exact; the control repeats too late and times out waiting for P's grant."""
    pair, request, d_caches, p, d = _filled_pair(50, 4, staging_grace_s=resend_s)
    try:
        pull = d.connect([p.handshake()]).pull("r1", request, timeout_s=6)
        until = time.perf_counter() + 0.3
        while time.perf_counter() < until:
            d.progress()
            p.progress()
        assert p.inbox.counts["unknown_sender"] >= 1  # the req P could not verify was dropped
        hold = p.connect([d.handshake()]).hold("r1", timeout_s=6)
        until = time.perf_counter() + 10
        while not (pull.settled and hold.settled) and time.perf_counter() < until:
            d.progress()
            p.progress()
            time.sleep(1e-3)
        if completes:
            assert pull.done and pull.failure is None, pull.failure
            assert check_caches(pair, request, d_caches)[0] == []
        else:
            assert pull.failure is not None and pull.failure.reason == "timeout", pull.failure
            assert "P's grant" in str(pull.failure)
    finally:
        d.close()
        p.close()


def test_a_closed_link_leaves_no_hmac_state_of_its_key() -> None:
    """The signed messages of a pull keep HMAC states derived from the link's key
    (kvgeom_nixl/protocol.py); closing the link forgets them with the key (control: they are
    there right before)."""
    from kvgeom_nixl import protocol

    pair, request, d_caches, p, d = _filled_pair(32, 2, warm_prober=False)
    try:
        d_link, p_link = d.connect([p.handshake()]), p.connect([d.handshake()])
        hold, pull = p_link.hold("r1", timeout_s=10), d_link.pull("r1", request, timeout_s=10)
        until = time.perf_counter() + 10
        while not (pull.settled and hold.settled) and time.perf_counter() < until:
            d.progress()
            p.progress()
            time.sleep(1e-3)
        assert pull.done and check_caches(pair, request, d_caches)[0] == []
        assert protocol._mac_prefix.cache_info().currsize >= 2  # (both directions of the link)
        d_link.close()
        assert protocol._mac_prefix.cache_info().currsize == 0
    finally:
        d.close()
        p.close()
