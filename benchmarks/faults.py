"""Fault campaign for the executor's fences (issue 19, docs/design.md §8.1): hung peers, late, replayed
and forged notifications, id reuse, cancels, out-of-order posting, floods, killed peers and a WRITE
half sent when its sender stops, on real NIXL.

    python -m benchmarks.faults            # the full campaign (about 10 minutes on a loaded 2-core box)
    python -m benchmarks.faults --quick    # a slice; tests/test_nixl_fences.py runs one of each in-process case
    python -m benchmarks.faults --json
    python -m benchmarks.faults --baseline 749dd83^1   # + the executor at that revision, timed in the same run

The in-process cases run P TP2 -> D TP1 (direct), or the packed order cases P TP1 -> D TP2 (each
chunk to 2 D ranks) and MLA P TP2 DCP2 -> D TP2 (each chunk from 2 P ranks into 2 D ranks, over
slow links). The kill rows SIGKILL a child process (the P engine while a D rank waits, or the D
engine while a P rank waits) in every mode; the half-sent row stops (SIGSTOP) a child P with a
packed WRITE half sent over UCX TCP. Cases assert nothing themselves: they count, per case::

    tried        scenarios run                      done       transfers that reported done
    false done   done although some D byte is wrong (the oracle: kvgeom.checking.check_decode), or
                 done for an attempt its peer gave up on
    wrong B      wrong D bytes in a request whose transfer reported done, or in blocks a later
                 request reused after the executor handed them back
    leaked       staging slots not free and NIXL handles not released once everything settled, and
                 (half-sent row) a half-written slot handed back while its writer may still write
    stalled      transfers that should have completed (or ended "aborted") but waited for a deadline
    inbox KB     the largest inbox (kept entries) seen       worst ms   the slowest progress() call
    detect ms    kill rows: from the SIGKILL to the typed ``peer_disconnected`` failure

The goal, every row: 0 false done, 0 wrong bytes, 0 leaked, 0 stalled, inbox under 64 MB, every
kill detected in under 1 s (``Row.ok``; the exit status is 1 otherwise).

The fence's cost (same run, the same descriptor lists): a direct pull through the executor (req,
grant, READ, held) against bare NIXL READs of the same lists with one notification, the old
executor's path; one notification round trip between two agents; and with ``--baseline`` the
executor at that revision next to this one (:mod:`benchmarks.fence_cost`).

Worked number: a fenced pull pays one notification round trip before its READ and one message after
it, so with a 60 us round trip a 0.2 ms pull costs about 0.3 ms.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import random
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import attrs

__all__ = ["Row", "campaign", "fence_cost", "kill_rows", "main", "render"]


@attrs.define
class Row:
    """One case's tally."""

    case: str
    tried: int = 0
    done: int = 0
    false_done: int = 0
    wrong_bytes: int = 0
    leaked: int = 0
    inbox_kb: float = 0.0
    worst_ms: float = 0.0
    detect_ms: float = 0.0
    stalled: int = 0  # transfers that should have completed (or ended "aborted") but waited for a deadline

    def ok(self) -> bool:
        return (self.false_done == 0 and self.wrong_bytes == 0 and self.leaked == 0 and self.inbox_kb < 64 * 1024
                and self.detect_ms < 1000.0 and self.stalled == 0)


def _env() -> None:
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
    os.environ.setdefault("UCX_NET_DEVICES", "lo")


class _Bench:
    """One deployment of the small direct pair, re-filled per scenario."""

    def __init__(self) -> None:
        from kvgeom import AttentionSpec, EngineGeometry, ModelSpec, Pair, fresh_request, plan_pair
        from kvgeom_nixl.local import LocalDeployment, allocate_caches, fill_caches

        m = ModelSpec("m", [AttentionSpec("attn", "full", 2, 4, 128)])
        self.pair = Pair(EngineGeometry.build(m, tp=2, kernel_block_tokens=16, num_blocks=8, name="prefill"),
                         EngineGeometry.build(m, tp=1, kernel_block_tokens=16, num_blocks=8, name="decode"))
        self.request = fresh_request(self.pair, 50, prefill_first_block=1, decode_first_block=4)
        self.plan = plan_pair(self.pair, self.request)
        self.p = allocate_caches(self.pair.prefill)
        self.d = allocate_caches(self.pair.decode)
        fill_caches(self.pair, self.request, self.p, self.d)
        self.dep = LocalDeployment(self.pair, self.p, self.d)
        self.worst = 0.0
        self.evil: Any = None  # an impostor agent (forged notifications), made on first use
        self.flooder: Any = None

    def refill(self) -> None:
        from kvgeom_nixl.local import fill_caches

        fill_caches(self.pair, self.request, self.p, self.d)

    def scribble_p(self, value: int) -> None:
        for regs in self.p:
            for t in regs:
                t.fill_(value)

    def wrong(self) -> int:
        from kvgeom_nixl.local import check_caches

        violations, _ = check_caches(self.pair, self.request, self.d, max_per_kind=None)
        return sum(int(getattr(v, "count", 1) or 1) for v in violations)

    def step(self, eps: Sequence[Any] | None = None) -> None:
        for ep in eps if eps is not None else self.dep.endpoints:
            t0 = time.perf_counter()
            ep.progress()
            self.worst = max(self.worst, time.perf_counter() - t0)

    def drive(self, until: Callable[[], bool], limit_s: float = 10.0, eps: Sequence[Any] | None = None) -> bool:
        deadline = time.perf_counter() + limit_s
        while not until():
            self.step(eps)
            if time.perf_counter() > deadline:
                return False
        return True

    def settle(self) -> int:
        """Drive everything to its end; the leaked slots and handles left behind."""
        eps = self.dep.endpoints
        self.drive(lambda: not any(e.in_flight or e.fencing for e in eps), 10)
        return sum(len(t.handles) for e in eps for t in e.fencing) + sum(len(e.fencing) for e in eps)

    def inbox_kb(self) -> float:
        return max(e.inbox.nbytes() for e in self.dep.endpoints) / 1024

    def close(self) -> None:
        self.dep.close()


def _late_push_retry(b: _Bench, row: Row, r: random.Random) -> None:
    """Row 1: D's accept times out while P hangs, D retries with the same id, P's attempt 1 lands late."""
    from kvgeom_nixl import TransferFailed

    dep, rid = b.dep, f"x{row.tried}"
    t1 = dep.d_links[0].accept_push(rid, b.request, plan=b.plan, timeout_s=0.05 + 0.1 * r.random())
    b.scribble_p(0xAB)
    p1 = [lk.push(rid, b.request, plan=b.plan, timeout_s=30) for lk in dep.p_links]
    b.drive(lambda: t1.settled, eps=dep.d)
    t2 = dep.d_links[0].accept_push(rid, b.request, plan=b.plan, timeout_s=20)
    b.drive(lambda: all(p.settled for p in p1) and t1.fenced)
    if t2.done:
        row.done += 1
        n = b.wrong()
        row.false_done += n > 0
        row.wrong_bytes += n
    b.refill()
    p2 = [lk.push(rid, b.request, plan=b.plan, timeout_s=20) for lk in dep.p_links]
    b.drive(lambda: t2.settled and all(p.settled for p in p2))
    row.done += sum(p.done for p in p1)  # attempt 1's push must not say done: D cancelled it
    row.false_done += sum(p.done for p in p1)
    if t2.done:
        row.done += 1
        n = b.wrong()
        row.false_done += n > 0
        row.wrong_bytes += n
    elif not isinstance(t2.failure, TransferFailed):
        row.leaked += 1


def _reuse_after_accept_timeout(b: _Bench, row: Row, r: random.Random) -> None:
    """Row 2: D's accept times out, D reuses the blocks once handed back, P's old push comes late."""
    dep, rid = b.dep, f"o{row.tried}"
    t = dep.d_links[0].accept_push(rid, b.request, plan=b.plan, timeout_s=0.05)
    early = r.random() < 0.5  # P posted its push before D gave up (it hung), or only afterwards
    pushes = [lk.push(rid, b.request, plan=b.plan, timeout_s=5) for lk in dep.p_links] if early else []
    b.drive(lambda: t.settled, eps=dep.d)
    b.drive(lambda: t.fenced)  # handed back: get_finished would report it now
    b.refill()
    y = [lk.pull(f"y{row.tried}", b.request, plan=b.plan, timeout_s=10) for lk in dep.d_links]
    y += [lk.serve_pull(f"y{row.tried}", b.request, plan=b.plan, timeout_s=10) for lk in dep.p_links]
    b.drive(lambda: all(x.settled for x in y))
    b.scribble_p(0xCD)
    if not early:
        pushes = [lk.push(rid, b.request, plan=b.plan, timeout_s=0.2) for lk in dep.p_links]
    b.drive(lambda: all(p.settled for p in pushes))
    row.done += sum(x.done for x in y[:1])
    n = b.wrong()
    row.wrong_bytes += n
    row.false_done += (n > 0) + sum(p.done for p in pushes)


def _pull_after_expiry(b: _Bench, row: Row, r: random.Random) -> None:
    """Row 3: P's hold expires (or is cancelled after its grant), P reuses its blocks, D's pull must fail."""
    dep, rid = b.dep, f"z{row.tried}"
    serves = [lk.serve_pull(rid, b.request, plan=b.plan, timeout_s=30) for lk in dep.p_links]
    t = dep.d_links[0].pull(rid, b.request, plan=b.plan, timeout_s=2)
    if r.random() < 0.5:
        b.drive(lambda: len(t.granted) == 2)
    for s in serves:
        s.cancel("timeout", "expired")
    b.scribble_p(0xCD)
    b.drive(lambda: t.settled)
    if t.done:
        row.done += 1
        n = b.wrong()
        row.false_done += n > 0
        row.wrong_bytes += n


def _forged(b: _Bench, row: Row, r: random.Random) -> None:
    """Row 5: an agent named as an honest P rank (it holds D's handshake) sends every kind of message."""
    from kvgeom_nixl.agent import make_agent

    dep = b.dep
    if b.evil is None:
        b.evil = make_agent(dep.p[0].name)
        b.evil.add_remote_agent(dep.d[0].rank_agent.metadata())
    rid = f"f{row.tried}"
    t = dep.d_links[0].accept_push(rid, b.request, plan=b.plan, timeout_s=0.1)
    kinds = ["pushed", "landed", "held", "grant", "cancel", "ended", "packed", "want", "slot"]
    for _ in range(20):
        k = r.choice(kinds)
        dn = f"{t.nonce:016x}" if r.random() < 0.5 else f"{r.getrandbits(64):016x}"
        b.evil.send_notif(dep.d[0].name, f"kvgeom2|{k}|{dn}|{r.getrandbits(64):016x}|0|0|{rid}|{'0' * 32}".encode())
        b.evil.send_notif(dep.d[0].name, f"kvgeom1|{k}|{rid}".encode())
        b.evil.get_new_notifs()
        b.step(dep.d)
    b.drive(lambda: t.settled, eps=dep.d)
    row.done += t.done
    row.false_done += t.done


def _id_reuse(b: _Bench, row: Row, r: random.Random) -> None:
    """A second transfer of an id in flight is refused; after the failure the same id lands every byte."""
    from kvgeom_nixl import DuplicateRequest

    dep, rid = b.dep, f"d{row.tried}"
    t = dep.d_links[0].pull(rid, b.request, plan=b.plan, timeout_s=0.05)
    try:
        dep.d_links[0].pull(rid, b.request, plan=b.plan)
        row.false_done += 1  # accepted twice
    except DuplicateRequest:
        pass
    b.drive(lambda: t.settled, eps=dep.d)
    b.drive(lambda: all((dep.d[0].name, t.nonce) in p.inbox.cancelled for p in dep.p))  # P saw D give up
    b.refill()
    ts = dep.post(rid, b.request, b.plan, timeout_s=10)
    b.drive(lambda: all(x.settled for x in ts))
    if ts[0].done:
        row.done += 1
        n = b.wrong()
        row.false_done += n > 0
        row.wrong_bytes += n


def _flood(b: _Bench, row: Row, r: random.Random) -> None:
    """Unknown senders with 256 KB ids, and a connected peer flooding signed reqs for ids nobody serves."""
    from kvgeom_nixl.protocol import encode

    dep = b.dep
    p0, d0 = dep.p[0], dep.d[0]
    if b.flooder is None:
        from kvgeom_nixl.agent import make_agent

        b.flooder = make_agent(f"made-up-{r.getrandbits(32)}")
        b.flooder.add_remote_agent(p0.rank_agent.metadata())
    for i in range(50):
        b.flooder.send_notif(p0.name, b"kvgeom2|req|" + b"0" * 33 + b"|1|" + b"x" * (256 << 10) + str(i).encode())
        b.flooder.get_new_notifs()
    key = d0.inbox.keys[p0.name]
    for i in range(1000):
        d0.rank_agent.send(p0.name, encode(key, d0.name, p0.name, "req", f"flood-{row.tried}-{i}-" + "y" * 200,
                                           i + 1, 0, 1))
    for _ in range(200):
        b.flooder.get_new_notifs()
        b.step([p0, d0])
    row.inbox_kb = max(row.inbox_kb, b.inbox_kb())


def _cancel_outcome(b: _Bench, row: Row, r: random.Random) -> None:
    """D gives up (cancel, or its deadline) before P's grant reached it, after it, or with its READs
    posted: every P attempt serving it ends "aborted" (docs/design.md §8.1), never done, never left
    holding until its own deadline."""
    dep, rid = b.dep, f"g{row.tried}"
    when = r.choice(["before the grant", "after the grant", "after the READ"])
    serves = [lk.hold(rid, timeout_s=30) if r.random() < 0.5 else lk.serve_pull(rid, b.request, plan=b.plan,
                                                                                   timeout_s=30)
              for lk in dep.p_links]
    t = dep.d_links[0].pull(rid, b.request, plan=b.plan, timeout_s=30)
    if when == "after the grant":
        b.drive(lambda: len(t.granted) == 2, eps=dep.d + dep.p)
    elif when == "after the READ":
        b.drive(lambda: t.nixl_requests == 2, eps=dep.d + dep.p)
    if r.random() < 0.5:
        t.cancel("closed", "the request was aborted on D")
    else:
        t.deadline = 0.0  # its deadline passes now
    b.drive(lambda: all(s.settled for s in serves) and t.settled, limit_s=5)
    row.done += sum(s.done for s in serves) + t.done
    row.false_done += sum(s.done for s in serves) + t.done
    row.stalled += sum(not s.settled or (s.failure is not None and s.failure.reason != "aborted") for s in serves)


def _slow_links(dep: Any, hold_s: float) -> None:
    """D rank d gets P rank d + 1's messages ``hold_s`` late (a slow link), in their order."""
    for rank, ep in enumerate(dep.d):
        slow, drain, until = dep.p[(rank + 1) % len(dep.p)].name, ep.rank_agent.drain, time.perf_counter() + hold_s
        held: list[tuple[str, bytes]] = []

        def slowed(slow: str = slow, drain: Any = drain, until: float = until,
                   held: list[tuple[str, bytes]] = held) -> list[tuple[str, bytes]]:
            got = drain()
            if time.perf_counter() < until:
                held += [m for m in got if m[0] == slow]
                return [m for m in got if m[0] != slow]
            out = held + got
            held.clear()
            return out

        ep.rank_agent.drain = slowed


def _order(push: bool, fan: str = "1x2") -> Callable[[Any, Row, random.Random], None]:
    def run(_: Any, row: Row, r: random.Random) -> None:
        """Packed requests posted in a different order on every rank: P TP1 -> D TP2 (each chunk to 2 D
        ranks), or MLA P TP2 DCP2 -> D TP2 (each chunk from 2 P ranks into 2 D ranks) with slow links
        (each D rank hears the two P ranks' orders in another interleaving)."""
        from kvgeom import AttentionSpec, EngineGeometry, ModelSpec, Pair, Topology, fresh_request
        from kvgeom_nixl.local import LocalDeployment, allocate_caches, check_caches, fill_caches, slot_bytes_for

        if fan == "2x2":
            m = ModelSpec("mla", [AttentionSpec("mla", "mla", 4, 1, 128)])
            pair = Pair(EngineGeometry.build(m, tp=2, kernel_block_tokens=16, num_blocks=8, name="prefill",
                                             topology=Topology(dcp=2)),
                        EngineGeometry.build(m, tp=2, kernel_block_tokens=16, num_blocks=8, name="decode"))
        else:
            m = ModelSpec("m", [AttentionSpec("attn", "full", 4, 4, 64)])
            pair = Pair(EngineGeometry.build(m, tp=1, kernel_block_tokens=16, num_blocks=8, name="prefill"),
                        EngineGeometry.build(m, tp=2, kernel_block_tokens=16, num_blocks=8, name="decode",
                                             layout="NHD"))
        request = fresh_request(pair, 60, prefill_first_block=1, decode_first_block=2)
        slot = max(slot_bytes_for(pair.plan(request, strategy="packed", staging_bytes=1 << 20)) // 4, 4096)
        plan = pair.plan(request, strategy="packed", staging_bytes=slot)
        p, d = allocate_caches(pair.prefill), allocate_caches(pair.decode)
        fill_caches(pair, request, p, d)
        ids = [f"s{i}" for i in range(20)]
        orders = []
        for _ in range(4):
            o = list(ids)
            r.shuffle(o)
            orders.append(o)
        with LocalDeployment(pair, p, d, staging_bytes=slot_bytes_for(plan)) as dep:
            if fan == "2x2":
                _slow_links(dep, 0.3)
            p_orders, d_orders = orders[:len(dep.p)], [ids, *orders[2:]][:len(dep.d)]
            if push:
                ts = [lk.push(i, request, plan=plan, timeout_s=20) for lk, o in zip(dep.p_links, p_orders) for i in o]
                ts += [lk.accept_push(i, request, plan=plan, timeout_s=20) for lk, o in zip(dep.d_links, d_orders)
                       for i in o]
            else:
                ts = [lk.pull(i, request, plan=plan, timeout_s=20) for lk, o in zip(dep.d_links, d_orders) for i in o]
                ts += [lk.serve_pull(i, request, plan=plan, timeout_s=20) for lk, o in zip(dep.p_links, p_orders)
                       for i in o]
            deadline = time.perf_counter() + 30
            while not all(t.settled for t in ts) and time.perf_counter() < deadline:
                for ep in dep.endpoints:
                    ep.progress()
            row.done += sum(t.done for t in ts if t.role == "decode")
            row.stalled += sum(not t.done for t in ts)  # here a failure is a storm: every request must complete
            deadline = time.perf_counter() + 10
            while any(ep.in_flight or ep.fencing for ep in dep.endpoints) and time.perf_counter() < deadline:
                for ep in dep.endpoints:
                    ep.progress()
            row.leaked += sum(ep.staging.slots - ep.staging.free() for ep in dep.endpoints if ep.staging)
            row.inbox_kb = max(row.inbox_kb, max(ep.inbox.nbytes() for ep in dep.endpoints) / 1024)
            n = len(check_caches(pair, request, d)[0])
            row.wrong_bytes += n
            row.false_done += n > 0
    return run


CASES: dict[str, Callable[[Any, Row, random.Random], None]] = {
    "late push, same-id retry": _late_push_retry,
    "push after accept timeout, reuse": _reuse_after_accept_timeout,
    "pull after P's expiry": _pull_after_expiry,
    "forged notifications": _forged,
    "id reuse": _id_reuse,
    "D gives up: P ends aborted": _cancel_outcome,
    "floods": _flood,
    "packed pulls, any order, 1 P -> 2 D": _order(False),
    "packed pushes, any order, 1 P -> 2 D": _order(True),
    "packed pulls, any order, 2 P -> 2 D": _order(False, "2x2"),
    "packed pushes, any order, 2 P -> 2 D": _order(True, "2x2"),
}


def campaign(counts: dict[str, int], seed: int = 19) -> list[Row]:
    """Run ``counts[case]`` scenarios of each case; one row per case."""
    _env()
    rows = []
    b = _Bench()
    try:
        for name, fn in CASES.items():
            row = Row(name)
            for i in range(counts.get(name, 0)):
                b.worst = 0.0
                fn(b, row, random.Random(seed * 1_000_003 + i))
                row.tried += 1
                row.leaked += b.settle()
                if "order" not in name:  # (the order cases run their own deployments and measure those)
                    row.inbox_kb = max(row.inbox_kb, b.inbox_kb())
                row.worst_ms = max(row.worst_ms, b.worst * 1e3)
            rows.append(row)
    finally:
        b.close()
    return rows


# ---- killed peers --------------------------------------------------------------------------------------

class _ChildEngine:
    """One engine of the pair in a spawned process (kvgeom_nixl.testing.engine_process), linked to
    endpoints of the other engine made here."""

    def __init__(self, pair: Any, request: Any, side: str, slot: int, ranks: Sequence[int] | None = None) -> None:
        from kvgeom import dump_pair_file
        from kvgeom_nixl import Endpoint
        from kvgeom_nixl.local import allocate_caches, fill_caches, rank_buffers
        from kvgeom_nixl.testing import engine_process

        ctx = mp.get_context("spawn")
        self.conn, child_conn = ctx.Pipe()
        self.proc = ctx.Process(target=engine_process, args=(child_conn, dump_pair_file(pair, request), side, "cpu",
                                                             slot), daemon=True)
        self.proc.start()
        child_conn.close()
        if self.proc.pid is None:
            raise RuntimeError("the child process did not start")
        self.pid: int = self.proc.pid
        self.eps: list[Any] = []
        try:
            hello = self.recv("hello", 300)[1]  # (a loaded machine: spawning torch + NIXL takes a while)
            mine = pair.decode if side == "prefill" else pair.prefill
            self.caches = allocate_caches(mine)
            other = allocate_caches(pair.prefill if side == "prefill" else pair.decode)
            if side == "prefill":
                fill_caches(pair, request, other, self.caches)
            else:
                fill_caches(pair, request, self.caches, other)
            role = "decode" if side == "prefill" else "prefill"
            for r in ranks if ranks is not None else range(mine.num_ranks):
                self.eps.append(Endpoint(mine, role, r, rank_buffers(mine, self.caches, r), staging_bytes=slot))
            self.links = [ep.connect(hello) for ep in self.eps]
            self.conn.send(("connect", [ep.handshake() for ep in self.eps]))
            self.recv("ready", 60)
        except BaseException:
            self.close()
            raise

    def recv(self, tag: str, timeout_s: float) -> Any:
        if not self.conn.poll(timeout_s):
            raise RuntimeError(f"the child sent nothing for {timeout_s} s (waiting for {tag!r})")
        msg = self.conn.recv()
        if msg[0] != tag:
            raise RuntimeError(f"the child answered {msg!r}, expected {tag!r}")
        return msg

    def close(self) -> None:
        import signal

        if self.proc.is_alive():
            os.kill(self.pid, signal.SIGCONT)
            self.proc.kill()
        self.proc.join(10)
        for ep in self.eps:
            ep.close()


def _kill_one(mode: str, victim: str = "P") -> float:
    """A child process (the P engine, or the D engine) SIGKILLed while a rank of the other engine here
    waits in ``mode``: ms from the kill to the typed ``peer_disconnected`` failure."""
    from kvgeom import AttentionSpec, EngineGeometry, ModelSpec, Pair, fresh_request, plan_pair
    from kvgeom_nixl import TransferFailed

    m = ModelSpec("m", [AttentionSpec("attn", "full", 2, 4, 128)])
    pair = Pair(EngineGeometry.build(m, tp=2, kernel_block_tokens=16, num_blocks=16, name="prefill"),
                EngineGeometry.build(m, tp=1, kernel_block_tokens=8, num_blocks=32, name="decode", layout="NHD"))
    request = fresh_request(pair, 190, prefill_first_block=1, decode_first_block=3)
    packed = mode.startswith("packed")
    slot = 1 << 16 if packed else 0
    child = _ChildEngine(pair, request, "prefill" if victim == "P" else "decode", slot, ranks=[0])
    try:
        ep, link = child.eps[0], child.links[0]
        plan = link.plan(request, strategy="packed") if packed else plan_pair(pair, request)
        kind = mode.split()[-1]
        if kind == "hold":
            t = link.hold("k", timeout_s=20)
        elif kind == "serve":
            t = link.serve_pull("k", request, plan=plan, timeout_s=20)
        elif kind == "accept":
            t = link.accept_push("k", request, plan=plan, timeout_s=20)
        else:
            t = getattr(link, kind)("k", request, plan=plan, timeout_s=20)
        for _ in range(20):
            ep.progress()
        child.proc.kill()  # SIGKILL
        child.proc.join(10)
        t0 = time.perf_counter()
        try:
            t.wait()
        except TransferFailed as e:
            if e.reason != "peer_disconnected":
                return float("inf")
        return (time.perf_counter() - t0) * 1e3
    finally:
        child.close()


KILLS = (("P", "pull"), ("P", "accept"), ("P", "packed pull"), ("P", "packed accept"),
         ("D", "hold"), ("D", "serve"), ("D", "push"), ("D", "packed serve"), ("D", "packed push"))


def kill_rows(repeats: int = 1) -> list[Row]:
    _env()
    rows = []
    for victim, mode in KILLS:
        waiting = "D" if victim == "P" else "P"
        row = Row(f"SIGKILL of {victim}, {waiting} in {mode}")
        for _ in range(repeats):
            row.detect_ms = max(row.detect_ms, _kill_one(mode, victim))
            row.tried += 1
        rows.append(row)
    return rows


# ---- a packed WRITE half sent when P stops (UCX over TCP) -------------------------------------------------

def _half_sent_one(row: Row) -> None:
    """P (a child) pushes a packed request of two 16 MiB chunks over UCX TCP and is stopped (SIGSTOP)
    when the first bytes land in D's slot; D's accept times out and D posts R2; the half-written slot
    must stay fenced (never granted to R2) until the WRITE's bytes have landed or P said ended; P
    resumes (SIGCONT) and pushes R2, which must land every byte; nothing may be left behind."""
    import signal

    from kvgeom import AttentionSpec, EngineGeometry, ModelSpec, Pair, fresh_request
    from kvgeom_nixl import TransferFailed, wait_all
    from kvgeom_nixl.local import check_caches

    os.environ["UCX_TLS"] = "tcp"  # (before the child is spawned and the endpoint made)
    try:
        m = ModelSpec("big", [AttentionSpec("attn", "full", 4, 8, 256)])
        pair = Pair(EngineGeometry.build(m, tp=1, kernel_block_tokens=16, num_blocks=136, name="prefill",
                                         layout="NHD"),
                    EngineGeometry.build(m, tp=1, kernel_block_tokens=16, num_blocks=136, name="decode"))
        request = fresh_request(pair, 2048, prefill_first_block=3, decode_first_block=5)
        child = _ChildEngine(pair, request, "prefill", 16 << 20)
    finally:
        del os.environ["UCX_TLS"]
    stopped = False
    try:
        ep, link = child.eps[0], child.links[0]
        plan = link.plan(request, strategy="packed")
        ring = ep.staging
        ring.tensor.fill_(0xEE)
        ends = {c: int((plan.wire.d_offset + plan.wire.nbytes)[plan.wire.chunk == c].max())
                for c in range(len(plan.chunks))}

        def landed(slot: int, lo: int, hi: int) -> bool:
            return bool((ring.view(slot)[lo:hi] != 0xEE).any())

        t1 = link.accept_push(f"h1-{row.tried}", request, plan=plan, timeout_s=120)
        child.conn.send(("push", t1.request_id, "coalesced", 120.0, "packed"))
        deadline = time.perf_counter() + 60
        while not any(landed(s, 0, 4096) for s in range(ring.slots)):
            ep.progress()
            if time.perf_counter() > deadline or t1.settled:
                raise RuntimeError("P's WRITE never started")
        os.kill(child.pid, signal.SIGSTOP)
        stopped = True
        until = time.perf_counter() + 1.0
        while time.perf_counter() < until:
            ep.progress()
        owners = {s: o for s, o in enumerate(ring.owner) if o is not None}
        half = [s for s, (_, c) in owners.items() if landed(s, 0, 4096) and not landed(s, ends[c] - 4096, ends[c])]
        if not half:
            raise RuntimeError(f"no WRITE is half sent (slots {owners}): the scenario did not happen")

        def fence_broken() -> bool:
            return any(ring.owner[s] != owners[s] and not landed(s, ends[owners[s][1]] - 4096, ends[owners[s][1]])
                       for s in half)

        try:
            t1.wait(timeout_s=0.2)
            row.false_done += 1  # done although P is stopped mid-WRITE
        except TransferFailed:
            pass
        t2 = link.accept_push(f"h2-{row.tried}", request, plan=plan, timeout_s=120)
        until = time.perf_counter() + 1.0
        while time.perf_counter() < until:
            ep.progress()
            row.leaked += fence_broken()  # a half-written slot handed back while P may write it
        os.kill(child.pid, signal.SIGCONT)
        stopped = False
        child.recv("failed", 60)
        child.conn.send(("push", t2.request_id, "coalesced", 120.0, "packed"))
        deadline = time.perf_counter() + 60
        while not t2.settled and time.perf_counter() < deadline:
            ep.progress()
            row.leaked += fence_broken()
        wait_all([t2], peers=child.eps)
        child.recv("done", 60)
        row.done += 1
        n = len(check_caches(pair, request, child.caches, max_per_kind=None)[0])
        row.wrong_bytes += n
        row.false_done += n > 0
        child.conn.send(("status",))
        status = child.recv("status", 30)[1]
        row.leaked += status["unreleased"] + status["in_flight"] + status["fencing"]
        row.leaked += status["slots"] - status["slots_free"] + (ring.slots - ring.free()) + len(ep.fencing)
    finally:
        if stopped:
            os.kill(child.pid, signal.SIGCONT)
        child.close()


def half_sent_row(repeats: int = 1) -> Row:
    _env()
    row = Row("packed WRITE half sent (TCP, P stopped)")
    for _ in range(repeats):
        _half_sent_one(row)
        row.tried += 1
    return row


# ---- the fence's cost ------------------------------------------------------------------------------------

def fence_cost(repeats: int = 30) -> dict[str, float]:
    """Medians (ms): a fenced direct pull through the executor, the same lists as bare NIXL READs (the old
    executor's path: post, wait, one notification), and one notification round trip."""
    _env()
    from benchmarks.transfer import RawNixl

    b = _Bench()
    try:
        dep = b.dep
        raw = RawNixl(dep, b.plan)
        fenced, bare, rtt = [], [], []
        for i in range(repeats + 3):
            t0 = time.perf_counter()
            dep.run(f"cost{i}", b.request, b.plan, timeout_s=10)
            t1 = time.perf_counter()
            raw()
            t2 = time.perf_counter()
            a, z = dep.d[0].rank_agent.nixl, dep.p[0].rank_agent.nixl
            a.send_notif(dep.p[0].name, b"rtt")
            while not z.get_new_notifs():
                a.get_new_notifs()
            z.send_notif(dep.d[0].name, b"rtt")
            while not a.get_new_notifs():
                z.get_new_notifs()
            t3 = time.perf_counter()
            if i >= 3:  # after UCX's wire-up
                fenced.append(t1 - t0)
                bare.append(t2 - t1)
                rtt.append(t3 - t2)
        return {"fenced_pull_ms": statistics.median(fenced) * 1e3, "bare_read_ms": statistics.median(bare) * 1e3,
                "notification_rtt_ms": statistics.median(rtt) * 1e3,
                "bytes": float(b.plan.bytes_copied)}
    finally:
        b.close()


def render(rows: Sequence[Row], cost: dict[str, float] | None = None) -> str:
    head = f"{'case':<40} {'tried':>5} {'done':>5} {'false done':>10} {'wrong B':>8} {'leaked':>6} {'stalled':>7} " \
           f"{'inbox KB':>8} {'worst ms':>8} {'detect ms':>9} ok"
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(f"{r.case:<40} {r.tried:>5} {r.done:>5} {r.false_done:>10} {r.wrong_bytes:>8} {r.leaked:>6} "
                     f"{r.stalled:>7} {r.inbox_kb:>8.1f} {r.worst_ms:>8.1f} {r.detect_ms:>9.1f} "
                     f"{'yes' if r.ok() else 'NO'}")
    if cost:
        lines.append("")
        lines.append(f"fence cost ({cost['bytes'] / 1024:.0f} KiB direct pull, P TP2 -> D TP1, in process): "
                     f"fenced pull {cost['fenced_pull_ms']:.3f} ms, bare NIXL READs of the same lists "
                     f"{cost['bare_read_ms']:.3f} ms ({cost['fenced_pull_ms'] / cost['bare_read_ms']:.2f}x), "
                     f"one notification round trip {cost['notification_rtt_ms']:.3f} ms")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.faults", description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="a slice (what the tests run)")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--baseline", help="a git revision of the executor (e.g. 749dd83^1, before the fences), "
                                           "timed next to this one in the same run (benchmarks.fence_cost)")
    args = parser.parse_args(argv)
    n = 3 if args.quick else 30
    counts = {name: (1 if "order" in name else n) for name in CASES}
    rows = campaign(counts) + kill_rows(1 if args.quick else 3) + [half_sent_row(1 if args.quick else 3)]
    cost = fence_cost(10 if args.quick else 50)
    before: dict[str, Any] | None = None
    if args.baseline:
        from benchmarks.fence_cost import compare
        from benchmarks.fence_cost import render as render_compare

        before = compare(args.baseline, 10 if args.quick else 40)
    if args.json:
        print(json.dumps({"rows": [attrs.asdict(r) for r in rows], "cost": cost, "baseline": before}))
    else:
        print(render(rows, cost))
        if before is not None:
            print()
            print(render_compare(before))
    return 0 if all(r.ok() for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
