"""Fault campaign for the executor's fences (issue 19, docs/design.md §8.1): hung peers, late, replayed
and forged notifications, id reuse, out-of-order posting, floods and killed peers, on real NIXL.

    python -m benchmarks.faults            # the full campaign (a few minutes on 2 cores)
    python -m benchmarks.faults --quick    # a slice (about a minute): what tests/test_nixl_fences.py runs
    python -m benchmarks.faults --json
    python -m benchmarks.faults --baseline /path/to/a/checkout/before/the/fences   # + the cost, before/after

Every case runs the executor in this process (P TP2 -> D TP1, or P TP1 -> D TP2 for the packed
order cases) and asserts nothing itself; it counts, and the table gives per case::

    tried        scenarios run                      done       transfers that reported done
    false done   done although some D byte is wrong (the oracle: kvgeom.checking.check_decode)
    wrong B      wrong D bytes in a request whose transfer reported done, or in blocks a later
                 request reused after the executor handed them back
    leaked       staging slots not free and NIXL handles not released once everything settled
    inbox KB     the largest inbox (kept entries) seen       worst ms   the slowest progress() call

and the kill rows (a child process SIGKILLed while each mode waits) give the time from the kill to
the typed ``peer_disconnected`` failure. The goal: 0 false done, 0 wrong bytes, 0 leaked, inbox under
64 MB, every kill detected in under 1 s.

The fence's cost (same run, the same descriptor lists): a direct pull through the executor (req,
grant, READ, held) against bare NIXL READs of the same lists with one notification, the old
executor's path; and one notification round trip between two agents.

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

    def ok(self) -> bool:
        return (self.false_done == 0 and self.wrong_bytes == 0 and self.leaked == 0 and self.inbox_kb < 64 * 1024
                and self.detect_ms < 1000.0)


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


def _order(push: bool) -> Callable[[Any, Row, random.Random], None]:
    def run(_: Any, row: Row, r: random.Random) -> None:
        """Packed requests posted in different orders on the two D ranks (P TP1 -> D TP2)."""
        from kvgeom import AttentionSpec, EngineGeometry, ModelSpec, Pair, fresh_request
        from kvgeom_nixl.local import LocalDeployment, allocate_caches, check_caches, fill_caches, slot_bytes_for

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
        other = list(ids)
        r.shuffle(other)
        with LocalDeployment(pair, p, d, staging_bytes=slot_bytes_for(plan)) as dep:
            if push:
                ts = [dep.p_links[0].push(i, request, plan=plan, timeout_s=20) for i in other]
                ts += [dep.d_links[0].accept_push(i, request, plan=plan, timeout_s=20) for i in ids]
                ts += [dep.d_links[1].accept_push(i, request, plan=plan, timeout_s=20) for i in reversed(ids)]
            else:
                ts = [dep.d_links[0].pull(i, request, plan=plan, timeout_s=20) for i in ids]
                ts += [dep.d_links[1].pull(i, request, plan=plan, timeout_s=20) for i in other]
                ts += [dep.p_links[0].serve_pull(i, request, plan=plan, timeout_s=20) for i in reversed(ids)]
            deadline = time.perf_counter() + 30
            while not all(t.settled for t in ts) and time.perf_counter() < deadline:
                for ep in dep.endpoints:
                    ep.progress()
            row.done += sum(t.done for t in ts if t.role == "decode")
            row.leaked += sum(not t.done for t in ts)  # here a failure is a storm: every request must complete
            row.leaked += sum(ep.staging.slots - ep.staging.free() for ep in dep.endpoints if ep.staging)
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
    "floods": _flood,
    "packed pulls, any order": _order(False),
    "packed pushes, any order": _order(True),
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
                row.inbox_kb = max(row.inbox_kb, b.inbox_kb())
                row.worst_ms = max(row.worst_ms, b.worst * 1e3)
            rows.append(row)
    finally:
        b.close()
    return rows


# ---- killed peers --------------------------------------------------------------------------------------

def _kill_one(mode: str) -> float:
    """A child P process SIGKILLed while this D rank waits in ``mode``: ms from the kill to the failure."""
    from kvgeom import AttentionSpec, EngineGeometry, ModelSpec, Pair, dump_pair_file, fresh_request, plan_pair
    from kvgeom_nixl import Endpoint, TransferFailed
    from kvgeom_nixl.local import allocate_caches, rank_buffers
    from kvgeom_nixl.testing import engine_process

    m = ModelSpec("m", [AttentionSpec("attn", "full", 2, 4, 128)])
    pair = Pair(EngineGeometry.build(m, tp=2, kernel_block_tokens=16, num_blocks=16, name="prefill"),
                EngineGeometry.build(m, tp=1, kernel_block_tokens=8, num_blocks=32, name="decode", layout="NHD"))
    request = fresh_request(pair, 190, prefill_first_block=1, decode_first_block=3)
    packed = mode.startswith("packed")
    slot = 1 << 16 if packed else 0
    ctx = mp.get_context("spawn")
    conn, child_conn = ctx.Pipe()
    proc = ctx.Process(target=engine_process, args=(child_conn, dump_pair_file(pair, request), "prefill", "cpu",
                                                    slot), daemon=True)
    proc.start()
    child_conn.close()
    try:
        if not conn.poll(60):
            raise RuntimeError("the child did not start")
        hello = conn.recv()[1]
        d = allocate_caches(pair.decode)
        ep = Endpoint(pair.decode, "decode", 0, rank_buffers(pair.decode, d, 0), staging_bytes=slot)
        link = ep.connect(hello)
        conn.send(("connect", [ep.handshake()]))
        conn.recv()
        plan = link.plan(request, strategy="packed") if packed else plan_pair(pair, request)
        if mode.endswith("pull"):
            t = link.pull("k", request, plan=plan, timeout_s=20)
        else:
            t = link.accept_push("k", request, plan=plan, timeout_s=20)
        for _ in range(20):
            ep.progress()
        proc.kill()  # SIGKILL
        proc.join(10)
        t0 = time.perf_counter()
        try:
            t.wait()
        except TransferFailed as e:
            if e.reason != "peer_disconnected":
                return float("inf")
        ms = (time.perf_counter() - t0) * 1e3
        ep.close()
        return ms
    finally:
        if proc.is_alive():
            proc.kill()


def kill_rows(repeats: int = 1) -> list[Row]:
    _env()
    rows = []
    for mode in ("pull", "push", "packed pull", "packed push"):
        row = Row(f"SIGKILL of P, D waiting in {mode}")
        for _ in range(repeats):
            row.detect_ms = max(row.detect_ms, _kill_one(mode))
            row.tried += 1
        rows.append(row)
    return rows


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


_TIME_RUNS = """
import os, statistics, sys, time
sys.path.insert(0, os.getcwd())
from kvgeom import AttentionSpec, EngineGeometry, ModelSpec, Pair, fresh_request, plan_pair
from kvgeom_nixl.local import LocalDeployment, allocate_caches, fill_caches
m = ModelSpec("m", [AttentionSpec("attn", "full", 2, 4, 128)])
pair = Pair(EngineGeometry.build(m, tp=2, kernel_block_tokens=16, num_blocks=8, name="prefill"),
            EngineGeometry.build(m, tp=1, kernel_block_tokens=16, num_blocks=8, name="decode"))
req = fresh_request(pair, 50, prefill_first_block=1, decode_first_block=4)
plan = plan_pair(pair, req)
p, d = allocate_caches(pair.prefill), allocate_caches(pair.decode)
fill_caches(pair, req, p, d)
with LocalDeployment(pair, p, d) as dep:
    ts = []
    for i in range(int(sys.argv[1]) + 5):
        t0 = time.perf_counter()
        dep.run(f"c{i}", req, plan, timeout_s=10)
        ts.append(time.perf_counter() - t0)
print(statistics.median(ts[5:]) * 1e3)
"""


def before_after(baseline: str, repeats: int = 50) -> dict[str, float]:
    """Median ms of one whole pull (D pulls, both P ranks serve, in process) by this checkout's executor
    and by the one at ``baseline`` (e.g. the executor before the fences), alternating, same machine."""
    import subprocess

    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out: dict[str, list[float]] = {"after_ms": [], "before_ms": []}
    for _ in range(3):
        for key, cwd in (("before_ms", baseline), ("after_ms", here)):
            res = subprocess.run([sys.executable, "-c", _TIME_RUNS, str(repeats)], cwd=cwd, capture_output=True,
                                 text=True, timeout=300, env={**os.environ, "PYTHONPATH": cwd})
            out[key].append(float(res.stdout.strip().splitlines()[-1]))
    return {k: statistics.median(v) for k, v in out.items()}


def render(rows: Sequence[Row], cost: dict[str, float] | None = None) -> str:
    head = f"{'case':<36} {'tried':>5} {'done':>5} {'false done':>10} {'wrong B':>8} {'leaked':>6} " \
           f"{'inbox KB':>8} {'worst ms':>8} {'detect ms':>9}"
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(f"{r.case:<36} {r.tried:>5} {r.done:>5} {r.false_done:>10} {r.wrong_bytes:>8} {r.leaked:>6} "
                     f"{r.inbox_kb:>8.1f} {r.worst_ms:>8.1f} {r.detect_ms:>9.1f}")
    if cost:
        lines.append("")
        lines.append(f"fence cost ({cost['bytes'] / 1024:.0f} KiB direct pull, P TP2 -> D TP1, in process): "
                     f"fenced pull {cost['fenced_pull_ms']:.3f} ms, bare NIXL READs of the same lists "
                     f"{cost['bare_read_ms']:.3f} ms ({cost['fenced_pull_ms'] / cost['bare_read_ms']:.2f}x), "
                     f"one notification round trip {cost['notification_rtt_ms']:.3f} ms")
        if "before_ms" in cost:
            lines.append(f"whole pull (D + both P ranks, executor): before the fences {cost['before_ms']:.3f} ms, "
                         f"after {cost['after_ms']:.3f} ms ({cost['after_ms'] / cost['before_ms']:.2f}x)")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.faults", description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="a slice (what the tests run)")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--baseline", help="a checkout of the executor before the fences, timed in the same run")
    args = parser.parse_args(argv)
    n = 3 if args.quick else 30
    counts = {name: (1 if "order" in name else n) for name in CASES}
    rows = campaign(counts) + kill_rows(1 if args.quick else 3)
    cost = fence_cost(10 if args.quick else 50)
    if args.baseline:
        cost.update(before_after(args.baseline, 20 if args.quick else 50))
    if args.json:
        print(json.dumps({"rows": [attrs.asdict(r) for r in rows], "cost": cost}))
    else:
        print(render(rows, cost))
    return 0 if all(r.ok() for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
