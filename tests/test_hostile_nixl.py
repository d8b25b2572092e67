"""A hostile peer through real NIXL (issue 11, docs/design.md §8 and §14).

Two fuzzers share one honest P endpoint and one D endpoint whose regions sit inside guard bytes
(``benchmarks/hostile.py``'s ``NixlBench``):

* mutated handshakes: a peer's payload mutated as bytes, as JSON and in its NIXL metadata
  (truncated, flipped, another agent's); ``connect``, then a pull if it connects;
* lying geometries: a peer whose handshake describes another valid geometry of the same model
  (other pages, strides, K, ppl, regions), with memory entries sized for the lie; ``connect`` and pull.

Each asserts that only typed errors (``KvGeomError`` subclasses, ``TransferFailed``) escape, that no
byte of D outside the request's writable pages or in the guards changes, and that an honest peer
still connects afterwards. The regressions are issue 11's defects 2, 4, 5 and 9, the writable
``invalid_blocks`` and the link's strategy and budget.
"""

from __future__ import annotations

import json
import os
import random
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
os.environ.setdefault("UCX_NET_DEVICES", "lo")
from nixl_env import NIXL_API  # noqa: E402

pytest.importorskip(NIXL_API, reason="nixl is not installed (pip install 'kvgeom[nixl]')")
pytest.importorskip("torch", reason="torch is not installed (pip install 'kvgeom[nixl]')")
pytest.importorskip("hypothesis", reason="the fuzzers need the testing extra (hypothesis)")

import base64  # noqa: E402

import numpy as np  # noqa: E402
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks import hostile  # noqa: E402
from kvgeom import (  # noqa: E402
    AttentionSpec,
    BlockList,
    EngineGeometry,
    GroupRequest,
    ModelSpec,
    Pair,
    PlanBudget,
    PlanBudgetExceeded,
    Request,
    fresh_request,
    plan_pair,
)
from kvgeom.checking import writable_pages  # noqa: E402
from kvgeom.tools import to_dict  # noqa: E402
from kvgeom_nixl import Endpoint, ExecutorError, HandshakeError, TransferFailed, wait_all  # noqa: E402
from kvgeom_nixl.handshake import HandshakeLimits  # noqa: E402
from kvgeom_nixl.local import LocalDeployment, allocate_caches, check_caches, fill_caches  # noqa: E402

CEILING_S = 20.0
def _fuzz(examples: int) -> settings:
    return settings(max_examples=examples, deadline=None, derandomize=True, database=None,
                    suppress_health_check=list(HealthCheck))


@pytest.fixture(scope="module")
def bench() -> Iterator[hostile.NixlBench]:
    b = hostile.NixlBench(seed=11)
    yield b
    b.close()


@_fuzz(250)
@given(seed=st.integers(0, 2**32 - 1))
def test_fuzz_mutated_handshakes(bench: hostile.NixlBench, seed: int) -> None:
    r = random.Random(seed)
    payloads, label = hostile.handshake_case(r, bench.honest)
    out = hostile.run_handshake(bench, payloads, label, r)
    assert out.kind in ("ok", "typed", "failed"), f"{label}: {out.kind}: {out.detail}"
    assert out.outside == 0 and out.ms < CEILING_S * 1e3, out


@_fuzz(50)
@given(seed=st.integers(0, 2**32 - 1))
def test_fuzz_lying_geometries_pulled_through_nixl(bench: hostile.NixlBench, seed: int) -> None:
    r = random.Random(seed)
    payloads, label = hostile.lying_case(r, bench.honest, bench.P)
    out = hostile.run_handshake(bench, payloads, label, r)
    assert out.kind in ("ok", "typed", "failed"), f"{label}: {out.kind}: {out.detail}"
    assert out.outside == 0 and out.ms < CEILING_S * 1e3, out


# ---- defect 5: one bad handshake poisoned the link ---------------------------------------------------------

@pytest.mark.parametrize("cut", [400, 300, 100])
def test_truncated_metadata_does_not_poison_the_endpoint(bench: hostile.NixlBench, cut: int) -> None:
    """NIXL 1.5 keeps the UCX connection of a blob whose memory sections fail to load; the old endpoint
    then refused every honest load of that peer (NIXL_ERR_INVALID_PARAM) until the process restarted."""
    doc = json.loads(bench.honest[0])
    md = base64.b64decode(doc["nixl_metadata"])
    doc["nixl_metadata"] = base64.b64encode(md[:cut]).decode()
    with pytest.raises(HandshakeError, match="NIXL refused the metadata"):
        bench.d.connect([json.dumps(doc).encode(), bench.honest[1]])
    link = bench.d.connect(bench.honest)  # the honest peer connects, and a pull lands
    try:
        request = fresh_request(link.pair, 20, decode_first_block=1)
        holds = bench.serve("after-truncation", 10)
        link.pull("after-truncation", request, timeout_s=10).wait(peers=bench.p)
        bench.settle(holds)
    finally:
        link.close()


def test_metadata_that_crashes_nixl_is_refused_and_the_process_survives(bench: hostile.NixlBench) -> None:
    """One flipped byte (a memory section's memory type, found by the hostile campaign) makes NIXL 1.5's
    ``add_remote_agent`` crash the process (SIGSEGV). The blob is loaded in the prober process first
    (kvgeom_nixl.probe): the prober crashes, the blob is refused, this process and its endpoint live on."""
    doc = json.loads(bench.honest[0])
    md = bytearray(base64.b64decode(doc["nixl_metadata"]))
    tag = md.find(b"nixlSDList|t")
    if tag < 0 or int.from_bytes(md[tag + 12:tag + 20], "little") != 4:
        pytest.skip("this NIXL serializes its memory sections differently")
    md[tag + 20 + 3] = 0x20  # the memory type becomes 0x20000000
    doc["nixl_metadata"] = base64.b64encode(bytes(md)).decode()
    with pytest.raises(HandshakeError, match="NIXL crashed on it|did not answer"):
        bench.d.connect([json.dumps(doc).encode(), bench.honest[1]])
    link = bench.d.connect(bench.honest)  # the next probe uses a restarted prober
    try:
        request = fresh_request(link.pair, 20, decode_first_block=1)
        holds = bench.serve("after-crash", 10)
        link.pull("after-crash", request, timeout_s=10).wait(peers=bench.p)
        bench.settle(holds)
    finally:
        link.close()


def test_metadata_of_another_agent_is_refused_before_it_is_loaded(bench: hostile.NixlBench) -> None:
    doc = json.loads(bench.honest[1])
    doc["nixl_metadata"] = json.loads(bench.honest[0])["nixl_metadata"]
    with pytest.raises(HandshakeError, match="the NIXL metadata is agent"):
        bench.d.connect([bench.honest[0], json.dumps(doc).encode()])
    bench.d.connect(bench.honest).close()


# ---- defect 2: a remote claiming huge sizes hung P; its timeout started after planning ---------------------

def test_handshake_maxima_refuse_absurd_remote_sizes(bench: hostile.NixlBench) -> None:
    for key, value, path in (("tp", 2**40, "$.engine.tp"), ("tp", 2048, "$.engine.tp")):
        doc = json.loads(bench.honest[0])
        doc["engine"][key] = value
        with pytest.raises(HandshakeError) as info:
            bench.d.connect([json.dumps(doc).encode()])
        assert info.value.path == path and "configured maximum" in str(info.value)
    doc = json.loads(bench.honest[0])
    for reg in doc["engine"]["regions"]:
        reg["num_pages"] = 2**33
    with pytest.raises(HandshakeError, match="pages in one region"):
        bench.d.connect([json.dumps(doc).encode()])
    with pytest.raises(HandshakeError, match="beyond the configured maximum of 1 ranks"):
        Endpoint(bench.D, "decode", 0, bench.d_views, limits=HandshakeLimits(max_ranks=1)).connect(bench.honest)
    with pytest.raises(HandshakeError, match="bytes, more than"):
        bench.d.connect([b" " * ((1 << 20) + 1)])


def test_serve_pull_refuses_a_huge_remote_before_planning() -> None:
    """P serves a D that claims tp = 2**20 (within raised handshake limits): the plan's estimate refuses in
    O(groups), before the planner's loop over 2**20 D ranks."""
    m = ModelSpec("m", [AttentionSpec("a", "full", 1, 2, 16)])
    P = EngineGeometry.build(m, tp=1, kernel_block_tokens=4, num_blocks=4, name="prefill")
    D = EngineGeometry.build(m, tp=2**20, kernel_block_tokens=4, num_blocks=4, name="decode")
    d_regions = [np.zeros(r.nbytes, np.uint8) for r in D.regions]  # one rank's memory, not 2**20 ranks'
    with Endpoint(P, "prefill", 0, allocate_caches(P)[0], limits=HandshakeLimits(max_tp=2**21, max_ranks=2**21)) as p0, \
            Endpoint(D, "decode", 0, d_regions) as d0:
        link = p0.connect([d0.handshake()])
        t0 = time.perf_counter()
        with pytest.raises(PlanBudgetExceeded, match="planner steps"):
            link.serve_pull("huge", fresh_request(link.pair, 8), timeout_s=5)
        assert time.perf_counter() - t0 < CEILING_S


def _deployment(S: int = 0, staging_bytes: int = 0) -> tuple[LocalDeployment, Any, Request, list[Any]]:
    m = ModelSpec("m", [AttentionSpec("a", "full", 2, 4, 64)])
    pair = Pair(EngineGeometry.build(m, tp=2, kernel_block_tokens=16, num_blocks=8, name="prefill"),
                EngineGeometry.build(m, tp=1, kernel_block_tokens=16, num_blocks=8, layout="NHD", name="decode"))
    request = fresh_request(pair, 50, prefill_first_block=1, decode_first_block=4)
    if S:  # D lists its held prefix blocks too (4, 5 hold [0, 32)), then 6 and 7
        g = request.groups[0]
        request = Request(50, [GroupRequest(g.prefill, BlockList((4, 5, 6, 7), 0))], S)
    p = allocate_caches(pair.prefill)
    d = allocate_caches(pair.decode)
    fill_caches(pair, request, p, d)
    return LocalDeployment(pair, p, d, staging_bytes=staging_bytes, staging_grace_s=0.05), pair, request, d


def test_the_timeout_covers_the_planning() -> None:
    dep, pair, request, _ = _deployment()
    with dep:
        t0 = time.perf_counter()
        t = dep.d_links[0].pull("late", request, timeout_s=1e-9)  # planning alone takes longer than that
        assert t.started <= t0 + (time.perf_counter() - t0) and t.deadline == t.started + 1e-9
        with pytest.raises(TransferFailed) as info:
            t.poll()
        assert info.value.reason == "timeout" and "nothing was posted" in info.value.detail and t.handles == []
        s = dep.p_links[0].serve_pull("late", request, timeout_s=1e-9)
        with pytest.raises(TransferFailed, match="timeout"):
            s.poll()


def test_packed_transfers_take_the_timeout_budget_and_invalid_blocks_too() -> None:
    """The packed path of a link (docs/design.md §12.5) keeps issue 11's rules: the deadline covers
    planning, the budget refuses before a plan is built, the inbox keeps what it waits for, and a
    failure names only the writable blocks."""
    dep, pair, request, d_caches = _deployment(S=32, staging_bytes=1 << 16)
    packed = plan_pair(pair, request, strategy="packed", staging_bytes=1 << 16)
    assert packed.packed and pair.writable_blocks(request) == {0: (6, 7)}
    with dep:
        t = dep.d_links[0].pull("late", request, strategy="packed", timeout_s=1e-9)
        with pytest.raises(TransferFailed) as info:
            t.poll()
        assert info.value.reason == "timeout" and "nothing was posted" in info.value.detail
        assert info.value.invalid_blocks == {0: (6, 7)}
        with pytest.raises(PlanBudgetExceeded):
            dep.d_links[0].pull("b", request, strategy="packed", budget=PlanBudget(max_steps=1))
        with pytest.raises(PlanBudgetExceeded):
            dep.p_links[0].serve_pull("b", request, strategy="packed", budget=PlanBudget(max_steps=1))
        t = dep.d_links[0].pull("unserved", request, strategy="packed", timeout_s=0.3)
        with pytest.raises(TransferFailed) as info:
            t.wait()  # P is never progressed
        assert info.value.reason == "timeout" and info.value.invalid_blocks == {0: (6, 7)}
        ts = [lk.pull("ok", request, strategy="packed", timeout_s=10) for lk in dep.d_links]
        ts += [lk.serve_pull("ok", request, strategy="packed", timeout_s=10) for lk in dep.p_links]
        for ep in dep.endpoints:  # what a transfer waits for is routed to it, never kept in the inbox
            ep.inbox.max_entries, ep.inbox.ttl_s = 0, 1e-6
        results = wait_all(ts, peers=dep.endpoints)
        assert results[0].chunks >= 1 and not any(ep.pending_notifications() for ep in dep.endpoints)
    assert check_caches(pair, request, d_caches)[0] == []


# ---- defect 4: timeout_s=nan disabled the deadline ---------------------------------------------------------

@pytest.mark.parametrize("bad", [float("nan"), float("inf"), 0, -1.0, "5", None, True])
def test_timeouts_must_be_finite_and_positive(bad: Any) -> None:
    dep, pair, request, _ = _deployment()
    with dep:
        for call in (lambda: dep.d_links[0].pull("t", request, timeout_s=bad),
                     lambda: dep.p_links[0].serve_pull("t", request, timeout_s=bad),
                     lambda: dep.p_links[0].push("t", request, timeout_s=bad),
                     lambda: dep.d_links[0].accept_push("t", request, timeout_s=bad)):
            with pytest.raises(ExecutorError) as info:
                call()
            assert info.value.path == "timeout_s"
        t = dep.d_links[0].pull("ok", request, timeout_s=10)
        holds = [lk.hold("ok", timeout_s=10) for lk in dep.p_links]
        if bad is not None:  # wait(timeout_s=None) keeps the transfer's own deadline
            with pytest.raises(ExecutorError, match="finite and > 0|number of seconds"):
                t.wait(timeout_s=bad)
        wait_all([t, *holds], peers=dep.endpoints)
        assert not dep.d[0].in_flight


# ---- defect 9: P kept one inbox entry forever for every pull it never served --------------------------------

def test_unserved_pull_notifications_expire_from_a_bounded_inbox() -> None:
    """D's reqs for pulls P never serves are the only entries kept for no transfer (docs/design.md
    §8.1): at most inbox_max of them, the oldest evicted first, none after their TTL."""
    dep, pair, request, _ = _deployment()
    with dep:
        p0 = dep.p[0].inbox
        p0.max_entries, p0.ttl_s = 3, 3600.0
        for i in range(6):  # D pulls six requests P never serves
            t = dep.d_links[0].pull(f"unserved-{i}", request, timeout_s=0.2)
            with pytest.raises(TransferFailed):
                t.wait(peers=dep.d)
        for _ in range(50):
            for e in dep.endpoints:
                e.progress()
        pending = [k for k in dep.p[0].pending_notifications() if k[1].startswith("unserved")]
        assert len(pending) <= 3 and p0.counts["evicted"] >= 0
        assert all(k[1] not in ("unserved-0", "unserved-1", "unserved-2") for k in pending)  # the oldest went
        p0.ttl_s = 1e-3  # everything kept is now too old
        time.sleep(0.01)
        s = [lk.serve_pull("served", request, timeout_s=10) for lk in dep.p_links]
        t = dep.d_links[0].pull("served", request, timeout_s=10)
        wait_all([t, *s], peers=dep.endpoints)
        assert not [k for k in dep.p[0].pending_notifications() if k[1].startswith("unserved")]


# ---- review: invalid_blocks lists only the blocks the transfer may have written ------------------------------

def test_a_failed_transfer_invalidates_only_its_writable_blocks() -> None:
    dep, pair, request, d_caches = _deployment(S=32)
    assert pair.writable_blocks(request) == {0: (6, 7)}
    masks = writable_pages(pair.decode, request)  # the simulator's writable pages: the same blocks
    assert sorted(np.flatnonzero(masks[0]).tolist()) == [6, 7]
    with dep:
        t = dep.d_links[0].pull("fails", request, timeout_s=0.2)
        with pytest.raises(TransferFailed) as info:
            t.wait()  # P is never progressed: the pull times out
        assert info.value.invalid_blocks == {0: (6, 7)}  # blocks 4 and 5 (held prefix) stay valid
        dep.run("retry", request, plan_pair(pair, request), timeout_s=10)
    assert check_caches(pair, request, d_caches)[0] == []


# ---- review: the link plans with the strategy and budget it is given ----------------------------------------

def test_link_planning_takes_a_strategy_and_a_budget() -> None:
    dep, pair, request, d_caches = _deployment()
    staged = plan_pair(pair, request, strategy="staged")
    assert staged.rearranges and staged != plan_pair(pair, request)
    with dep:
        assert dep.d_links[0].plan(request, strategy="staged") == staged
        with pytest.raises(PlanBudgetExceeded):
            dep.d_links[0].plan(request, budget=PlanBudget(max_bytes=1))
        with pytest.raises(PlanBudgetExceeded):
            dep.p_links[0].serve_pull("b", request, budget=PlanBudget(max_steps=1))
        ts = [lk.pull("s", request, strategy="staged", timeout_s=10) for lk in dep.d_links]
        ts += [lk.serve_pull("s", request, strategy="staged", timeout_s=10) for lk in dep.p_links]
        results = wait_all(ts, peers=dep.endpoints)
        assert results[0].rearranges == len(staged.for_decode_rank(0).rearranges) > 0
    assert check_caches(pair, request, d_caches)[0] == []


def test_request_ids_and_requests_are_checked(bench: hostile.NixlBench) -> None:
    link = bench.d.connect(bench.honest)
    try:
        for bad in ("", "a|b", None, 7, "x" * 300):
            with pytest.raises(ExecutorError, match="request_id"):
                link.pull(bad, timeout_s=1)  # type: ignore[arg-type]
        with pytest.raises(ExecutorError, match="expected Request"):
            link.pull("r", "not a request", timeout_s=1)  # type: ignore[arg-type]
    finally:
        link.close()


def test_the_lie_is_written_with_the_peer_memory_it_claims(bench: hostile.NixlBench) -> None:
    """The lying-geometry generator really changes the geometry and sizes the memory entries for it."""
    payloads, _ = hostile.lying_case(random.Random(3), bench.honest, bench.P)
    doc = json.loads(payloads[0])
    assert doc["engine"] != to_dict(bench.P) or doc["memory"]["regions"] != json.loads(bench.honest[0])["memory"]
