"""Issue 19: no transfer reports done with bytes another attempt wrote, and nothing is handed back while
a peer may still touch it (docs/design.md §8.1, §12.5). One regression per row of the issue's table,
on real NIXL in this process (the kill cases are in test_nixl_crossprocess.py and below).

Each scenario is written so that the executor before issue 19 fails it (shown by running this file
against main's kvgeom_nixl): a late push of attempt 1 completed the same-id retry; a D rank reused
its blocks while P's old push could still land; a pull after P's hold expired read P's new bytes and
reported done; forged notifications completed or aborted transfers; floods were stored whole;
packed pulls posted in different orders stalled until their deadlines.
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

from kvgeom import AttentionSpec, EngineGeometry, ModelSpec, Pair, fresh_request, plan_pair  # noqa: E402
from kvgeom_nixl import ExecutorError, TransferFailed, wait_all  # noqa: E402
from kvgeom_nixl.local import LocalDeployment, allocate_caches, check_caches, fill_caches  # noqa: E402

M = ModelSpec("m", [AttentionSpec("attn", "full", 2, 4, 128)])
PAIR = Pair(EngineGeometry.build(M, tp=2, kernel_block_tokens=16, num_blocks=8, name="prefill"),
            EngineGeometry.build(M, tp=1, kernel_block_tokens=16, num_blocks=8, name="decode"))
REQUEST = fresh_request(PAIR, 50, prefill_first_block=1, decode_first_block=4)  # D blocks 4..7
PLAN = plan_pair(PAIR, REQUEST)


def _deployment(**kw: Any) -> tuple[LocalDeployment, list[Any], list[Any]]:
    p = allocate_caches(PAIR.prefill)
    d = allocate_caches(PAIR.decode)
    fill_caches(PAIR, REQUEST, p, d)
    return LocalDeployment(PAIR, p, d, **kw), p, d


def _scribble(caches: list[Any], value: int) -> None:
    """Other bytes in every cache (what a rank holds after it reused its blocks)."""
    for regs in caches:
        for t in regs:
            t.fill_(value)


def _drive(eps: list[Any], until: Any, limit_s: float = 10.0) -> None:
    deadline = time.perf_counter() + limit_s
    while not until():
        for ep in eps:
            ep.progress()
        assert time.perf_counter() < deadline, "not reached"


def _free(t: Any) -> bool:
    """Whether the executor hands ``t``'s blocks back (before issue 19: as soon as it failed)."""
    return bool(getattr(t, "fenced", t.settled))


def _wrong(d_caches: list[Any]) -> int:
    return len(check_caches(PAIR, REQUEST, d_caches, max_per_kind=None)[0])


# ---- row 1: same-id retry after an accept timeout --------------------------------------------------------

def test_same_id_retry_is_not_completed_by_the_late_push_of_attempt_1() -> None:
    dep, p_caches, d_caches = _deployment()
    with dep:
        t1 = dep.d_links[0].accept_push("x", REQUEST, plan=PLAN, timeout_s=0.3)
        _scribble(p_caches, 0xAB)  # what P holds for attempt 1 (P recomputes the request for attempt 2)
        p1 = [lk.push("x", REQUEST, plan=PLAN, timeout_s=30) for lk in dep.p_links]
        with pytest.raises(TransferFailed):
            t1.wait()  # P hangs (never progressed): D's accept times out
        t2 = dep.d_links[0].accept_push("x", REQUEST, plan=PLAN, timeout_s=20)  # the connector retries, same id
        _drive(dep.endpoints, lambda: all(p.settled for p in p1) and _free(t1))  # P resumes: attempt 1 lands late
        assert not t2.done or _wrong(d_caches) == 0, "the retry took attempt 1's bytes"
        fill_caches(PAIR, REQUEST, p_caches, allocate_caches(PAIR.decode))  # P's bytes for attempt 2
        p2 = [lk.push("x", REQUEST, plan=PLAN, timeout_s=20) for lk in dep.p_links]
        wait_all([t2, *p2], peers=dep.endpoints)
        assert _wrong(d_caches) == 0
        assert all(p.failure is not None for p in p1)  # attempt 1's push learned D's cancel: not done
        assert dep.d[0].inbox.counts["stale"] + dep.p[0].inbox.counts["stale"] >= 0


# ---- row 2: a direct push after D timed out --------------------------------------------------------------

def test_blocks_reused_after_an_accept_timeout_are_not_overwritten_by_the_old_push() -> None:
    dep, p_caches, d_caches = _deployment()
    with dep:
        t = dep.d_links[0].accept_push("old", REQUEST, plan=PLAN, timeout_s=0.3)
        with pytest.raises(TransferFailed):
            t.wait()  # P never progressed
        _drive(dep.endpoints, lambda: _free(t))  # the blocks are handed back once P's attempt is known ended
        fill_caches(PAIR, REQUEST, p_caches, d_caches)
        dep.run("Y", REQUEST, PLAN, timeout_s=10)  # D reuses the blocks for request Y (same bytes: checkable)
        assert _wrong(d_caches) == 0
        _scribble(p_caches, 0xCD)  # P has moved on; its late push of "old" would write these
        late = [lk.push("old", REQUEST, plan=PLAN, timeout_s=0.3) for lk in dep.p_links]
        for _ in range(200):
            for ep in dep.endpoints:
                ep.progress()
        assert _wrong(d_caches) == 0, "the old push wrote into Y's blocks"
        assert not any(p.done for p in late)  # P does not report done either
        _drive(dep.endpoints, lambda: all(p.settled for p in late))


def test_an_accept_timeout_stays_fenced_while_p_may_still_write() -> None:
    dep, p_caches, d_caches = _deployment()
    with dep:
        t = dep.d_links[0].accept_push("f", REQUEST, plan=PLAN, timeout_s=0.3)
        pushes = [lk.push("f", REQUEST, plan=PLAN, timeout_s=30) for lk in dep.p_links]
        _drive([dep.d[0]], lambda: t.settled)  # the connector loop: no wait(), only get_finished()
        assert t.failure is not None and t.failure.reason == "timeout"
        assert not t.fenced and dep.d[0].fencing == (t,)  # P got the req: it may write until it says otherwise
        assert dep.d[0].get_finished().failed == ()  # a connector is not told the blocks are free yet
        _drive(dep.endpoints, lambda: t.fenced)
        f = dep.d[0].get_finished()
        assert f.failed_ids == {"f"} and f.invalid_blocks() == {0: {4, 5, 6, 7}}
        assert all(p.failure is not None and p.failure.reason == "aborted" for p in pushes)


# ---- row 3: a direct pull after P's hold expired ---------------------------------------------------------

def test_a_pull_after_p_expired_fails_instead_of_reading_new_bytes() -> None:
    dep, p_caches, d_caches = _deployment()
    with dep:
        serves = [lk.serve_pull("z", REQUEST, plan=PLAN, timeout_s=0.2) for lk in dep.p_links]
        with pytest.raises(TransferFailed):
            wait_all(serves, peers=dep.p)  # D never came: P's hold expires
        _scribble(p_caches, 0xCD)  # P reuses its blocks
        t = dep.d_links[0].pull("z", REQUEST, plan=PLAN, timeout_s=2)
        with pytest.raises(TransferFailed) as ei:
            t.wait(peers=dep.endpoints)
        assert ei.value.reason in ("aborted", "timeout")


def test_a_read_that_finishes_after_the_hold_ended_is_not_done() -> None:
    dep, p_caches, d_caches = _deployment()
    with dep:
        serves = [lk.serve_pull("r", REQUEST, plan=PLAN, timeout_s=30) for lk in dep.p_links]
        t = dep.d_links[0].pull("r", REQUEST, plan=PLAN, timeout_s=10)
        _drive(dep.endpoints, lambda: len(t.granted) == 2)  # both P ranks granted; D posts its READs
        for s in serves:  # P gives up (its expiry) before D's READ notification is answered
            s.cancel("timeout", "expired")
        _scribble(p_caches, 0xCD)
        with pytest.raises(TransferFailed) as ei:
            t.wait(peers=dep.endpoints)
        assert ei.value.reason == "aborted"


# ---- row 5: forged notifications -------------------------------------------------------------------------

def _impostor(dep: LocalDeployment, name: str) -> Any:
    """A NIXL agent named as an honest rank, holding D's (or P's) handshake: it can send notifications."""
    from kvgeom_nixl.agent import make_agent

    a = make_agent(name)
    for ep in dep.endpoints:
        if ep.name != name:
            a.add_remote_agent(ep.rank_agent.metadata())
    return a


@pytest.mark.parametrize("forged", [b"kvgeom1|pushed|fx", b"kvgeom2|pushed|0000000000000001|0000000000000002|fx|"
                                    + b"0" * 32])
def test_forged_notifications_complete_abort_or_steer_nothing(forged: bytes) -> None:
    dep, p_caches, d_caches = _deployment()
    _scribble(d_caches, 0x11)  # nothing writes these: a "done" would hand them out
    with dep:
        evil = _impostor(dep, dep.p[0].name)  # the honest P rank's name (it is in P's handshake)
        evil_p1 = _impostor(dep, dep.p[1].name)
        t = dep.d_links[0].accept_push("fx", REQUEST, plan=PLAN, timeout_s=0.5)
        pulled = [lk.serve_pull("fy", REQUEST, plan=PLAN, timeout_s=0.5) for lk in dep.p_links]
        pull = dep.d_links[0].pull("fz", REQUEST, plan=PLAN, timeout_s=0.5)
        for _ in range(20):
            for a in (evil, evil_p1):
                a.send_notif(dep.d[0].name, forged)
                a.send_notif(dep.d[0].name, b"kvgeom1|abort|fz")
                a.send_notif(dep.d[0].name, b"kvgeom2|cancel|0000000000000001|0000000000000000|fz|" + b"0" * 32)
            evil.send_notif(dep.p[1].name, b"kvgeom1|pulled|fy")  # named as P rank 0, to P rank 1 ...
            evil_p1.send_notif(dep.p[0].name, b"kvgeom1|pulled|fy")  # ... and the other way round
            for a in (evil, evil_p1):
                a.get_new_notifs()  # (its own UCX worker progresses: the messages go out)
            for ep in dep.endpoints:
                ep.progress()
        with pytest.raises(TransferFailed) as ei:
            t.wait(peers=dep.d)
        assert ei.value.reason == "timeout", dep.d[0].inbox.counts  # never done over blocks nothing wrote
        with pytest.raises(TransferFailed) as ei:
            wait_all(pulled, peers=dep.p)
        assert ei.value.reason == "timeout"  # never done though D never read
        with pytest.raises(TransferFailed) as ei:
            pull.wait(peers=dep.d)  # P is not progressed: no grant; a spoofed abort/cancel does not end it
        assert ei.value.reason == "timeout"
        assert dep.d[0].inbox.counts["rejected"] > 0 and not dep.d[0].pending_notifications()


# ---- floods: bounded inbox -------------------------------------------------------------------------------

def test_floods_are_dropped_before_they_are_stored() -> None:
    """Ids of 256 KB, unknown senders, and a peer's flood of signed reqs: the inbox stays bounded."""
    from kvgeom_nixl.protocol import encode

    dep, p_caches, d_caches = _deployment()
    with dep:
        p0 = dep.p[0]
        p0.inbox.max_entries = 64  # (Endpoint(inbox_max=64))
        d_name = dep.d[0].name
        evil = _impostor(dep, "made-up-sender")
        for i in range(300):
            evil.send_notif(p0.name, b"kvgeom2|req|" + b"0" * 33 + b"|1|" + b"x" * (256 << 10) + str(i).encode())
            evil.get_new_notifs()
        key = dep.d[0].inbox.keys[p0.name]  # a connected peer (the D rank) floods reqs for ids P never serves
        for i in range(2000):
            dep.d[0].rank_agent.send(p0.name, encode(key, d_name, p0.name, "req", f"flood-{i}", i + 1, 0, 1))
        t0 = time.perf_counter()
        class Sender:  # the flooder's UCX worker progresses too (large messages go out as it does)
            def progress(self) -> None:
                evil.get_new_notifs()

        _drive([p0, dep.d[0], Sender()], lambda: p0.inbox.counts["kept"] + p0.inbox.counts["unknown_sender"] >= 2300)
        elapsed = time.perf_counter() - t0
        assert len(p0.inbox.pending) <= 64 and p0.inbox.counts["evicted"] >= 2000 - 64
        assert p0.inbox.nbytes() < 1 << 20
        assert p0.inbox.counts["unknown_sender"] == 300  # nothing of theirs was stored
        assert elapsed < 10
        t1 = time.perf_counter()
        for _ in range(100):
            p0.progress()
        assert (time.perf_counter() - t1) / 100 < 5e-3  # an idle progress stays cheap after the flood
        dep.run("after", REQUEST, PLAN, timeout_s=10)  # the honest traffic still flows
        assert _wrong(d_caches) == 0


# ---- ids -----------------------------------------------------------------------------------------------

def test_an_id_in_flight_is_refused_and_a_retry_after_a_failure_is_safe() -> None:
    from kvgeom_nixl import DuplicateRequest

    dep, p_caches, d_caches = _deployment()
    with dep:
        t = dep.d_links[0].pull("dup", REQUEST, plan=PLAN, timeout_s=0.3)
        with pytest.raises(DuplicateRequest, match="already in flight"):
            dep.d_links[0].pull("dup", REQUEST, plan=PLAN)
        other = dep.d[0].connect([p.handshake() for p in dep.p], probe=False)  # the same id on another link
        with pytest.raises(DuplicateRequest):
            other.accept_push("dup", REQUEST, plan=PLAN)
        assert isinstance(DuplicateRequest("a", "b"), ExecutorError)
        with pytest.raises(TransferFailed):
            t.wait()
        d_name = dep.d[0].name  # P learns of the failed attempt (its req, then its cancel) before P serves again
        _drive(dep.endpoints, lambda: all((d_name, t.nonce) in p.inbox.cancelled for p in dep.p))
        fill_caches(PAIR, REQUEST, allocate_caches(PAIR.prefill), d_caches)  # D's blocks back to stale bytes
        dep.run("dup", REQUEST, PLAN, timeout_s=10)  # the same id again, after the failure: every byte right
        assert _wrong(d_caches) == 0


@pytest.mark.parametrize("heard_grant", [False, True])
def test_a_d_rank_that_gives_up_ends_the_serve_as_aborted(heard_grant: bool) -> None:
    """The one outcome of D's cancel (docs/design.md §8.1): every P attempt serving that D rank ends
    failed, "aborted", whether or not D had heard P's grant; never done and never left holding."""
    dep, p_caches, d_caches = _deployment()
    with dep:
        t = dep.d_links[0].pull("g", REQUEST, plan=PLAN, timeout_s=30)
        if heard_grant:
            holds = [lk.hold("g", timeout_s=30) for lk in dep.p_links]
            _drive(dep.endpoints, lambda: len(t.granted) == 2)
        else:  # D's req waits in P's inbox; the holds grant as they are posted; D never reads the grants
            _drive(dep.endpoints, lambda: all(p.pending_notifications() for p in dep.p))
            holds = [lk.hold("g", timeout_s=30) for lk in dep.p_links]
            assert all(h.granted for h in holds) and not t.granted  # D's cancel names no P attempt
        t.cancel("closed", "the request was aborted on D")
        _drive(dep.endpoints, lambda: all(h.settled for h in holds) and t.fenced)
        assert [h.failure.reason if h.failure else "done" for h in holds] == ["aborted", "aborted"]
        assert all(h.fenced for h in holds) and not any(ep.in_flight or ep.fencing for ep in dep.endpoints)


# ---- the connector loop ----------------------------------------------------------------------------------

def test_hold_without_a_plan_and_get_finished() -> None:
    """P knows only its own blocks: ``hold(id)``; D pulls; both learn the end from get_finished."""
    dep, p_caches, d_caches = _deployment()
    with dep:
        holds = [lk.hold("c1", timeout_s=10) for lk in dep.p_links]
        t = dep.d_links[0].pull("c1", REQUEST, timeout_s=10)  # planned on D alone (its rank plan)
        done: set[str] = set()
        deadline = time.perf_counter() + 10
        while len(done) < 3:
            for ep in dep.endpoints:
                f = ep.get_finished()
                assert not f.failed
                done |= {f"{ep.role}{ep.rank}:{i}" for i in f.done_ids}
            assert time.perf_counter() < deadline
        assert done == {"prefill0:c1", "prefill1:c1", "decode0:c1"}
        assert t.done and all(h.done for h in holds) and _wrong(d_caches) == 0
        assert dep.d[0].get_finished().done == ()  # each end is reported once


def test_hold_counts_the_consumers_d_announces_on_a_tp2_decode() -> None:
    pair = Pair(EngineGeometry.build(M, tp=1, kernel_block_tokens=16, num_blocks=8, name="prefill"),
                EngineGeometry.build(M, tp=2, kernel_block_tokens=16, num_blocks=8, name="decode"))
    request = fresh_request(pair, 40, prefill_first_block=1, decode_first_block=2)
    p, d = allocate_caches(pair.prefill), allocate_caches(pair.decode)
    fill_caches(pair, request, p, d)
    with LocalDeployment(pair, p, d) as dep:
        hold = dep.p_links[0].hold("c2", timeout_s=10)
        first = dep.d_links[0].pull("c2", request, timeout_s=10)
        wait_all([first], peers=dep.endpoints)
        assert not hold.settled and hold.expect_count == 2  # D rank 0 said 2 D ranks read from P rank 0
        wait_all([dep.d_links[1].pull("c2", request, timeout_s=10), hold], peers=dep.endpoints)
        assert check_caches(pair, request, d)[0] == []


# ---- eager pulls: the READ at once, P's held decides (no req, no grant) ------------------------------------

def _sent_kinds(ep: Any) -> list[str]:
    """Wrap ``ep``'s sender: the kinds of the messages it sends from now on (standalone ones, not
    those riding on a NIXL request)."""
    kinds: list[str] = []
    send = ep.rank_agent.send

    def spy(peer: str, message: bytes) -> None:
        kinds.append(message.split(b"|")[1].decode())
        send(peer, message)

    ep.rank_agent.send = spy
    return kinds


@pytest.mark.parametrize("eager", [True, False])
def test_an_eager_pull_reads_at_once_and_moves_every_byte(eager: bool) -> None:
    """Eager: D's READs are posted in D's first progress, before P has run at all, and D sends no
    ``req``; the pull ends done with every byte right once P said ``held``. The control (not eager)
    posts nothing before P's grant and sends a req to each P rank."""
    dep, p_caches, d_caches = _deployment()
    with dep:
        holds = [lk.hold("e1", timeout_s=10) for lk in dep.p_links]
        sent = _sent_kinds(dep.d[0])
        t = dep.d_links[0].pull("e1", REQUEST, plan=PLAN, timeout_s=10, eager=eager)
        assert t.nixl_requests == 0  # (nothing is posted from the caller's thread)
        dep.d[0].progress()  # D alone: P has not run
        assert t.nixl_requests == (2 if eager else 0)  # one READ per P rank
        assert sent.count("req") == (0 if eager else 2)
        wait_all([t, *holds], peers=dep.endpoints)
        assert _wrong(d_caches) == 0 and all(h.done for h in holds)
        assert "req" not in sent if eager else "req" in sent


def test_an_eager_read_of_blocks_p_let_go_fails_and_is_never_done() -> None:
    """P's holds ended (expired), P reused its blocks; D's eager READ moves P's new bytes, and P
    answers ``cancel``: the pull fails with its D blocks invalid. (The same pull asking first is
    test_a_pull_after_p_expired_fails_instead_of_reading_new_bytes.)"""
    dep, p_caches, d_caches = _deployment()
    with dep:
        serves = [lk.serve_pull("x", REQUEST, plan=PLAN, timeout_s=0.2) for lk in dep.p_links]
        with pytest.raises(TransferFailed):
            wait_all(serves, peers=dep.p)  # D never came: P's holds expire
        _scribble(p_caches, 0xCD)  # P reuses its blocks
        t = dep.d_links[0].pull("x", REQUEST, plan=PLAN, timeout_s=5, eager=True)
        dep.d[0].progress()
        assert t.nixl_requests == 2  # the READs went out: P's bytes are not the request's any more
        with pytest.raises(TransferFailed) as ei:
            t.wait(peers=dep.endpoints)
        assert ei.value.reason == "aborted" and ei.value.invalid_blocks == {0: (4, 5, 6, 7)}
        assert not t.done and _wrong(d_caches) > 0  # the wrong bytes landed, and were never called done


def test_an_eager_read_that_lands_after_the_hold_ended_is_not_done() -> None:
    dep, p_caches, d_caches = _deployment()
    with dep:
        holds = [lk.hold("y", timeout_s=30) for lk in dep.p_links]
        t = dep.d_links[0].pull("y", REQUEST, plan=PLAN, timeout_s=10, eager=True)
        for h in holds:  # P gives up (its lease) before it reads D's "read"
            h.cancel("timeout", "expired")
        _scribble(p_caches, 0xCD)
        with pytest.raises(TransferFailed) as ei:
            t.wait(peers=dep.endpoints)
        assert ei.value.reason == "aborted"


def test_an_eager_read_before_p_holds_waits_in_p_inbox_then_completes() -> None:
    """The connector's order: D's READ (and its ``read``) can reach P before P's worker holds the
    request; P keeps the ``read`` (one entry per id and D rank, as a ``req``), and the hold, once
    posted, takes it and confirms."""
    dep, p_caches, d_caches = _deployment()
    with dep:
        t = dep.d_links[0].pull("w", REQUEST, plan=PLAN, timeout_s=10, eager=True)
        _drive(dep.endpoints, lambda: all(("read", "w") in p.pending_notifications() for p in dep.p))
        assert not t.settled
        holds = [lk.hold("w", timeout_s=10) for lk in dep.p_links]
        wait_all([t, *holds], peers=dep.endpoints)
        assert _wrong(d_caches) == 0 and not any(p.pending_notifications() for p in dep.p)


def test_an_eager_read_p_dropped_is_repeated_once_the_read_is_done() -> None:
    """The ``read`` riding on each READ is lost on its way to P (each P rank's drain drops the
    first one); D repeats it as a plain message every ``resend_s`` once its READs are DONE, and the
    pull completes. Control: with nothing dropped, no plain ``read`` is sent."""
    for drop in (True, False):
        dep, _, d = _deployment(staging_grace_s=0.2)
        with dep:
            dropped: list[str] = []
            if drop:
                for ep in dep.p:
                    _DropFirstRead(ep, dropped)
            holds = [lk.hold("v", timeout_s=10) for lk in dep.p_links]
            sent = _sent_kinds(dep.d[0])
            t = dep.d_links[0].pull("v", REQUEST, plan=PLAN, timeout_s=10, eager=True)
            wait_all([t, *holds], peers=dep.endpoints)
            assert _wrong(d) == 0
            assert (len(dropped), sent.count("read")) == ((2, 2) if drop else (0, 0))


class _DropFirstRead:
    """An endpoint's drain that loses the first ``read`` message of each sender."""

    def __init__(self, endpoint: Any, dropped: list[str]) -> None:
        self.drain = endpoint.rank_agent.drain
        self.dropped = dropped
        self.seen: set[str] = set()
        endpoint.rank_agent.drain = self

    def __call__(self) -> list[tuple[str, bytes]]:
        out = []
        for sender, raw in self.drain():
            if raw.split(b"|")[1:2] == [b"read"] and sender not in self.seen:
                self.seen.add(sender)
                self.dropped.append(sender)
                continue
            out.append((sender, raw))
        return out


# ---- no storm from posting order (packed) -------------------------------------------------------------

ORDER_PAIRS = {  # (P TP, P DCP, D TP), and per chunk: the most P ranks a D rank reads, D ranks a P rank feeds
    "P TP1 -> D TP2": ((1, 1, 2), (1, 2)),  # one P rank feeds both D ranks
    "P TP2 -> D TP4": ((2, 1, 4), (1, 2)),  # each P rank feeds 2 D ranks, each D rank reads 1 P rank
    "P TP2 DCP2 -> D TP2, MLA": ((2, 2, 2), (2, 2)),  # each D rank reads every token: from both P ranks
}


def _order_pair(name: str) -> tuple[Pair, Any]:
    from kvgeom import Topology

    (p_tp, dcp, d_tp), _ = ORDER_PAIRS[name]
    if dcp > 1:  # one latent head, its tokens split over the P ranks, replicated on every D rank
        m = ModelSpec("mla", [AttentionSpec("mla", "mla", 4, 1, 128)])
        layout = "HND"
    else:
        m = ModelSpec("m", [AttentionSpec("attn", "full", 4, 4, 64)])
        layout = "NHD"
    pair = Pair(EngineGeometry.build(m, tp=p_tp, kernel_block_tokens=16, num_blocks=8, name="prefill",
                                     topology=Topology(dcp=dcp)),
                EngineGeometry.build(m, tp=d_tp, kernel_block_tokens=16, num_blocks=8, name="decode", layout=layout))
    return pair, fresh_request(pair, 60, prefill_first_block=1, decode_first_block=2)


class _SlowLink:
    """A D rank's drain that holds back one P rank's messages for ``hold_s`` (a slow link), then
    delivers them in their order before anything newer from that rank."""

    def __init__(self, endpoint: Any, slow: str, hold_s: float) -> None:
        self.drain = endpoint.rank_agent.drain
        self.slow = slow
        self.until = time.perf_counter() + hold_s
        self.held: list[tuple[str, bytes]] = []
        endpoint.rank_agent.drain = self

    def __call__(self) -> list[tuple[str, bytes]]:
        got = self.drain()
        if time.perf_counter() < self.until:
            self.held += [m for m in got if m[0] == self.slow]
            return [m for m in got if m[0] != self.slow]
        out, self.held = self.held + got, []
        return out


@pytest.mark.parametrize("push", [False, True], ids=["pull", "push"])
@pytest.mark.parametrize("pair_name", list(ORDER_PAIRS))
def test_packed_requests_posted_in_different_orders_all_complete(pair_name: str, push: bool) -> None:
    """20 packed requests of 3+ chunks through 2-slot rings, every rank posting them in its own order
    (D rank 0 in order, D rank 1 with one adjacent swap, the others reversed; P rank 0 in order, P
    rank 1 shuffled). Before issue 19 33 of 40 pulls of P TP1 -> D TP2 timed out (each D ring held
    slots for the request it saw first); with several P ranks feeding several D ranks two D rings
    could still grant in different orders and hold each other's chunks until the deadline (P TP2
    DCP2 -> D TP2). Now every chunk takes its D slots one D rank at a time, in rank order, and each P
    rank's part is read as soon as it is packed: every request completes (a deadline here fails it),
    every slot is free afterwards and every D byte is right. The links are uneven on purpose: D rank d
    gets P rank d + 1's messages 0.3 s late, so that where two P ranks feed a chunk, each D ring hears
    the two P ranks' orders in another interleaving (the executor before this fix: every request of
    P TP2 DCP2 -> D TP2 timed out)."""
    import random

    from kvgeom_nixl.local import slot_bytes_for

    pair, request = _order_pair(pair_name)
    whole = pair.plan(request, strategy="packed", staging_bytes=1 << 20)
    slot = max(slot_bytes_for(whole) // 4, 4096)
    plan = pair.plan(request, strategy="packed", staging_bytes=slot)
    assert len(plan.chunks) >= 3
    w = plan.wire
    fan_in = max(len(set(w.p_rank[(w.chunk == c) & (w.d_rank == d)].tolist())) for c, d in zip(w.chunk, w.d_rank))
    fan_out = max(len(set(w.d_rank[(w.chunk == c) & (w.p_rank == p)].tolist())) for c, p in zip(w.chunk, w.p_rank))
    assert (fan_in, fan_out) == ORDER_PAIRS[pair_name][1]
    p, d = allocate_caches(pair.prefill), allocate_caches(pair.decode)
    fill_caches(pair, request, p, d)
    ids = [f"s{i}" for i in range(20)]
    shuffled = list(ids)
    random.Random(19).shuffle(shuffled)
    d_orders = [ids, ids[:10] + [ids[11], ids[10]] + ids[12:]] + [ids[::-1]] * (pair.decode.num_ranks - 2)
    p_orders = [ids, shuffled][:pair.prefill.num_ranks]
    with LocalDeployment(pair, p, d, staging_bytes=slot_bytes_for(plan)) as dep:
        for rank, ep in enumerate(dep.d):
            _SlowLink(ep, dep.p[(rank + 1) % len(dep.p)].name, 0.3)
        ts = []
        if push:
            ts += [lk.push(i, request, plan=plan, timeout_s=30) for lk, order in zip(dep.p_links, p_orders) for i in order]
            ts += [lk.accept_push(i, request, plan=plan, timeout_s=30) for lk, order in zip(dep.d_links, d_orders)
                   for i in order]
        else:
            ts += [lk.pull(i, request, plan=plan, timeout_s=30) for lk, order in zip(dep.d_links, d_orders)
                   for i in order]
            ts += [lk.serve_pull(i, request, plan=plan, timeout_s=30) for lk, order in zip(dep.p_links, p_orders)
                   for i in order]
        deadline = time.perf_counter() + 60
        while not all(t.settled for t in ts) and time.perf_counter() < deadline:
            for ep in dep.endpoints:
                ep.progress()
        failed = [(t.request_id, t.role, t.rank, t.failure.reason) for t in ts if t.failure is not None]
        assert not failed and all(t.done for t in ts), failed[:6]
        assert all(ep.staging is not None and ep.staging.free() == ep.staging.slots for ep in dep.endpoints)
    assert check_caches(pair, request, d)[0] == []


def test_the_fault_campaign_quick_slice() -> None:
    """One scenario of each case of ``python -m benchmarks.faults`` (the kill rows are above and in
    test_nixl_crossprocess.py): 0 false done, 0 wrong bytes, nothing leaked, the inbox bounded."""
    import sys
    from pathlib import Path

    root = str(Path(__file__).resolve().parents[1])
    if root not in sys.path:
        sys.path.insert(0, root)
    from benchmarks import faults

    in_process = [name for name in faults.CASES if "order" not in name]  # (the order cases are above)
    rows = faults.campaign({name: 1 for name in in_process})
    assert len(rows) == len(faults.CASES) and all(r.ok() for r in rows), faults.render(rows)
    assert sum(r.tried for r in rows) == len(in_process) == 7
    for broken in (faults.Row("control", tried=1, false_done=1), faults.Row("control", stalled=1),
                   faults.Row("control", detect_ms=1000.0), faults.Row("control", inbox_kb=64 * 1024)):
        assert not broken.ok()  # each check can fail
