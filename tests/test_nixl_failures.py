"""Failures end in a typed TransferFailed within a bound, with every NIXL handle released.

In-process cases here; the killed-peer case (a child process that dies mid-transfer) is in
test_nixl_crossprocess.py.
"""

from __future__ import annotations

import os
import time
from typing import Any

import pytest

os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
os.environ.setdefault("UCX_NET_DEVICES", "lo")
from nixl_env import NIXL_API  # noqa: E402

pytest.importorskip(NIXL_API, reason="nixl is not installed (pip install 'kvgeom[nixl]')")
pytest.importorskip("torch", reason="torch is not installed (pip install 'kvgeom[nixl]')")

from kvgeom import (  # noqa: E402
    AttentionSpec,
    EngineGeometry,
    ModelSpec,
    Pair,
    fresh_request,
    plan_pair,  # noqa: E402
)
from kvgeom_nixl import Endpoint, ExecutorError, TransferFailed, wait_all  # noqa: E402
from kvgeom_nixl.errors import FAILURE_REASONS  # noqa: E402
from kvgeom_nixl.local import LocalDeployment, allocate_caches, check_caches, fill_caches  # noqa: E402
from kvgeom_nixl.testing import requested_device  # noqa: E402

DEVICE = requested_device()
M = ModelSpec("m", [AttentionSpec("attn", "full", 2, 4, 128)])
PAIR = Pair(EngineGeometry.build(M, tp=2, kernel_block_tokens=16, num_blocks=8, name="prefill"),
            EngineGeometry.build(M, tp=1, kernel_block_tokens=16, num_blocks=8, name="decode"))
REQUEST = fresh_request(PAIR, 50, prefill_first_block=1, decode_first_block=4)  # D blocks 4..7
PLAN = plan_pair(PAIR, REQUEST)


def _deployment() -> tuple[LocalDeployment, list[list[Any]]]:
    p = allocate_caches(PAIR.prefill, DEVICE)
    d = allocate_caches(PAIR.decode, DEVICE)
    fill_caches(PAIR, REQUEST, p, d)
    return LocalDeployment(PAIR, p, d), d


def _released(handles: list[Any]) -> bool:
    return all(h._released for h in handles)  # nixl_xfer_handle's own flag


@pytest.mark.parametrize("mode", ["coalesced", "prepped"])
def test_timeout_when_the_peer_never_progresses(mode: str) -> None:
    """A P rank nobody polls never grants: D's pull posts no READ and times out waiting for the grant."""
    dep, _ = _deployment()
    with dep:
        t = dep.d_links[0].pull("slow", REQUEST, plan=PLAN, mode=mode, timeout_s=0.3)
        start = time.perf_counter()
        with pytest.raises(TransferFailed) as ei:
            t.wait()  # no peers given: the P agents are never progressed
        elapsed = time.perf_counter() - start
        e = ei.value
        assert e.reason == "timeout" and e.request_id == "slow" and e.kind == "pull" and e.role == "decode"
        assert "P's grant" in e.detail and e.invalid_blocks == {0: (4, 5, 6, 7)}
        assert elapsed < 0.3 + 1.0
        assert t.handles == [] and t.fenced and not dep.d[0].in_flight
        # the same link works afterwards once both sides are polled
        dep.run("ok", REQUEST, PLAN, mode=mode, timeout_s=10)


@pytest.mark.parametrize("mode", ["coalesced", "prepped"])
def test_timeout_after_the_grant_releases_every_handle(mode: str) -> None:
    """P grants, then stops progressing: D's READs are posted and the pull times out (P never says
    ``held``); every NIXL handle is released once NIXL no longer reports it in progress."""
    dep, _ = _deployment()
    with dep:
        serves = [lk.serve_pull("slow", REQUEST, plan=PLAN, timeout_s=30) for lk in dep.p_links]
        t = dep.d_links[0].pull("slow", REQUEST, plan=PLAN, mode=mode, timeout_s=0.5)
        deadline = time.perf_counter() + 5
        while t.nixl_requests < 2 and time.perf_counter() < deadline:
            for ep in dep.endpoints:
                ep.progress()
        assert t.nixl_requests == 2  # one NIXL request per P rank, posted after each grant
        handles = list(t.handles)
        with pytest.raises(TransferFailed) as ei:
            t.wait()  # P is no longer progressed: its "held" never comes
        assert ei.value.reason == "timeout"
        assert not t.fenced or _released(handles)  # a READ NIXL still reports in progress keeps its handle
        deadline = time.perf_counter() + 10
        while not t.fenced:  # P progresses again: the READs finish, NIXL reports them, D releases them
            for ep in dep.endpoints:
                ep.progress()
            assert time.perf_counter() < deadline
        assert _released(handles) and t.handles == []
        # D gave up after P's grant reached it (its cancel names P's attempt): every serve ends failed,
        # "aborted", whichever of D's messages (pulled, cancel, ended) P reads first (docs/design.md §8.1)
        deadline = time.perf_counter() + 10
        while not all(s.settled for s in serves):
            for ep in dep.endpoints:
                ep.progress()
            assert time.perf_counter() < deadline
        assert [s.failure.reason if s.failure else "done" for s in serves] == ["aborted", "aborted"]


def test_accept_push_times_out_without_writes() -> None:
    dep, _ = _deployment()
    with dep:
        t = dep.d_links[0].accept_push("never", REQUEST, plan=PLAN, timeout_s=0.2)
        with pytest.raises(TransferFailed, match="waiting for notifications") as ei:
            wait_all([t], peers=dep.endpoints)
        assert ei.value.reason == "timeout" and ei.value.invalid_blocks == {0: (4, 5, 6, 7)}
        s = dep.p_links[0].serve_pull("never", REQUEST, plan=PLAN, timeout_s=0.2)
        with pytest.raises(TransferFailed) as ei2:
            s.wait(peers=dep.endpoints)
        assert ei2.value.reason == "timeout" and ei2.value.invalid_blocks == {}  # P has no D blocks


@pytest.mark.parametrize("mode", ["coalesced", "prepped"])
def test_post_against_a_removed_agent(mode: str) -> None:
    dep, d_caches = _deployment()
    with dep:
        if mode == "prepped":  # prepare the peer tables first, so the removal invalidates live handles
            dep.run("warm", REQUEST, PLAN, mode=mode)
        for p in dep.p:
            dep.d[0].agent.remove_remote_agent(p.name)
        before = [t.clone() for t in d_caches[0]]
        t = dep.d_links[0].pull("gone", REQUEST, plan=PLAN, mode=mode)
        assert t.settled and t.handles == []  # failed sending its first message, nothing left behind
        with pytest.raises(TransferFailed) as ei:
            t.poll()
        assert ei.value.reason == "nixl_error" and "nixlNotFoundError" in str(ei.value)
        assert ei.value.invalid_blocks == {0: (4, 5, 6, 7)}
        assert all(a.equal(b) for a, b in zip(before, d_caches[0], strict=True))  # no receive step ran


def test_close_fails_what_is_in_flight() -> None:
    dep, _ = _deployment()
    t = dep.d_links[0].pull("cut", REQUEST, plan=PLAN, timeout_s=30)
    handles = list(t.handles)
    dep.close()
    with pytest.raises(TransferFailed) as ei:
        t.poll()
    assert ei.value.reason == "closed" and _released(handles)
    with pytest.raises(ExecutorError, match="closed link"):
        dep.d_links[0].pull("after", REQUEST, plan=PLAN)


def test_plan_that_leaves_the_peer_region_is_refused_before_posting() -> None:
    """An untrusted plan (or a lying peer): a copy past a region's end never reaches NIXL."""
    from kvgeom import Copies, TransferPlan

    c = PLAN.copies
    shifted = c.d_offset.copy()
    shifted[-1] = PAIR.decode.regions[0].nbytes - int(c.nbytes[-1]) + 1  # the last copy ends 1 B past the region
    bad = Copies(c.p_rank, c.p_region, c.p_offset, c.d_rank, c.d_region, shifted, c.nbytes)
    plan = TransferPlan(PLAN.prefill_tp, PLAN.decode_tp, bad, PLAN.zeros)
    dep, d_caches = _deployment()
    with dep:
        before = [t.clone() for t in d_caches[0]]
        t = dep.d_links[0].pull("evil", REQUEST, plan=plan)
        with pytest.raises(TransferFailed) as ei:
            t.poll()
        assert ei.value.reason == "plan_error" and "leave region" in str(ei.value)
        assert all(a.equal(b) for a, b in zip(before, d_caches[0], strict=True))


def test_mode_and_role_errors_are_value_errors() -> None:
    dep, _ = _deployment()
    with dep:
        with pytest.raises(ExecutorError, match="unknown lowering mode 'fast'"):
            dep.d_links[0].pull("x", REQUEST, plan=PLAN, mode="fast")
        with pytest.raises(ExecutorError, match="push runs on a prefill rank"):
            dep.d_links[0].push("x", REQUEST, plan=PLAN)
        with pytest.raises(ExecutorError, match="needs the request"):
            dep.d_links[0].pull("x")


def test_each_method_without_a_request_names_its_own_fix() -> None:
    """Issue 20 item 8: one text used to say ``fix: link.pull(request_id, request)`` for all four."""
    dep, _ = _deployment()
    with dep:
        for call, fix in ((lambda: dep.d_links[0].pull("x"), "link.pull(request_id, request)"),
                          (lambda: dep.p_links[0].push("x"), "link.push(request_id, request)"),
                          (lambda: dep.d_links[0].accept_push("x"), "link.accept_push(request_id, request)"),
                          (lambda: dep.p_links[0].serve_pull("x"), "link.serve_pull(request_id, request)")):
            with pytest.raises(ExecutorError) as ei:
                call()
            assert ei.value.fix is not None and ei.value.fix.startswith(fix), (fix, ei.value.fix)
        with pytest.raises(ExecutorError) as ei:
            dep.p_links[0].serve_pull("x")
        assert "link.hold(request_id)" in str(ei.value.fix)


def test_failure_pickles_with_its_fields() -> None:
    import pickle

    e = TransferFailed("r", "timeout", "slow", invalid_blocks={0: tuple(range(10))}, kind="pull", role="decode", rank=1)
    e2 = pickle.loads(pickle.dumps(e))
    assert (e2.request_id, e2.reason, e2.invalid_blocks, e2.rank) == ("r", "timeout", {0: tuple(range(10))}, 1)
    assert "group 0: [0, 1, 2, 3, 4, 5, ... (10 blocks)]" in str(e2)
    assert set(FAILURE_REASONS) >= {"timeout", "peer_disconnected", "nixl_error", "plan_error", "closed"}


def test_verified_after_a_failed_attempt() -> None:
    """A request that failed can be retried on the same link and then lands every byte."""
    dep, d_caches = _deployment()
    with dep:
        t = dep.d_links[0].pull("try1", REQUEST, plan=PLAN, timeout_s=0.2)
        with pytest.raises(TransferFailed):
            t.wait()
        dep.run("try2", REQUEST, PLAN, timeout_s=10)
    assert check_caches(PAIR, REQUEST, d_caches)[0] == []


def test_link_without_a_needed_peer_rank_refuses_the_request() -> None:
    p = allocate_caches(PAIR.prefill, DEVICE)
    d = allocate_caches(PAIR.decode, DEVICE)
    with Endpoint(PAIR.prefill, "prefill", 0, p[0]) as p0, Endpoint(PAIR.decode, "decode", 0, d[0]) as d0:
        link = d0.connect([p0.handshake()])  # P rank 1 never connected
        with pytest.raises(ExecutorError, match="needs peer rank 1"):
            link.pull("x", REQUEST, plan=PLAN)
        with pytest.raises(ExecutorError, match="needs peer rank 1"):
            link.accept_push("x", REQUEST, plan=PLAN)
        assert not d0.in_flight
