"""P ranks and D ranks in different processes (multiprocessing "spawn"), handshakes over a pipe.

The child hosts every rank of one engine (kvgeom_nixl.testing.engine_process); the parent hosts
the other. Bytes are verified with the simulator on the D side. Each child costs ~2 s to start
(torch + NIXL import, UCX load). Five tests cover transfers: three on TP pairs, and two on topologies
(docs/design.md §11): P PP2 x TP1 -> D TP2 (every stage's ranks hand over their handshakes, each
D rank pulls layers 0-1 from stage 0 and 2-3 from stage 1), and an MLA pair P TP2 DCP2 -> D TP1
(the D rank gathers even tokens from P rank 0 and odd ones from P rank 1). Then packed transfers,
kills in every mode, and a packed WRITE half sent over UCX TCP when P is stopped (SIGSTOP), with
its control (slots freed on a timer).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import time
from collections.abc import Iterator
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
    Request,
    Topology,
    dump_pair_file,  # noqa: E402
    fresh_request,
    plan_pair,  # noqa: E402
)
from kvgeom_nixl import Endpoint, TransferFailed, wait_all  # noqa: E402
from kvgeom_nixl.local import allocate_caches, check_caches, fill_caches, rank_buffers  # noqa: E402
from kvgeom_nixl.testing import engine_process, requested_device  # noqa: E402

DEVICE = requested_device()
M = ModelSpec("m", [AttentionSpec("attn", "full", 2, 4, 128)])


def _pair(p_tp: int, d_tp: int) -> tuple[Pair, Request]:
    pair = Pair(EngineGeometry.build(M, tp=p_tp, kernel_block_tokens=16, num_blocks=16, name="prefill"),
                EngineGeometry.build(M, tp=d_tp, kernel_block_tokens=8, num_blocks=32, name="decode", layout="NHD"))
    return pair, fresh_request(pair, 190, prefill_first_block=1, decode_first_block=3)  # D zeros tokens 190..191


class Child:
    """One engine in a spawned process, driven over a pipe (see kvgeom_nixl.testing)."""

    def __init__(self, pair: Pair, request: Request, side: str, staging_bytes: int = 0) -> None:
        ctx = mp.get_context("spawn")
        self.conn, child_conn = ctx.Pipe()
        self.proc = ctx.Process(target=engine_process, args=(child_conn, dump_pair_file(pair, request), side, DEVICE,
                                                             staging_bytes), daemon=True)
        self.proc.start()
        child_conn.close()
        self.handshakes = self.recv("hello", 60)[1]

    def recv(self, tag: str, timeout_s: float) -> Any:
        if not self.conn.poll(timeout_s):
            raise AssertionError(f"child sent nothing for {timeout_s} s (waiting for {tag!r})")
        msg = self.conn.recv()
        assert msg[0] == tag, msg
        return msg

    def send(self, *msg: Any) -> None:
        self.conn.send(msg)

    def stop(self) -> None:
        if self.proc.is_alive():
            try:
                self.send("close")
                self.conn.poll(10)
            except (BrokenPipeError, EOFError, OSError):
                pass
        self.proc.join(10)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(5)


def _connected(pair: Pair, request: Request, child_side: str, stopper: list[Any],
               staging_bytes: int = 0) -> tuple[Child, list[Endpoint], list[list[Any]], list[Any]]:
    """A child process for ``child_side`` and this process's endpoints for the other side, linked
    both ways (handshakes over the pipe); everything is registered with ``stopper``."""
    child = Child(pair, request, child_side, staging_bytes)
    stopper.append(child)
    eps, caches = _local(pair, request, "decode" if child_side == "prefill" else "prefill", staging_bytes)
    stopper.extend(eps)
    links = [e.connect(child.handshakes) for e in eps]
    child.send("connect", [e.handshake() for e in eps])
    child.recv("ready", 30)
    return child, eps, caches, links


def _local(pair: Pair, request: Request, side: str, staging_bytes: int = 0) -> tuple[list[Endpoint], list[list[Any]]]:
    engine = pair.side(side)
    p = allocate_caches(pair.prefill, DEVICE if side == "prefill" else "cpu")
    d = allocate_caches(pair.decode, DEVICE if side == "decode" else "cpu")
    fill_caches(pair, request, p, d)
    mine = p if side == "prefill" else d
    return [Endpoint(engine, side, r, rank_buffers(engine, mine, r), staging_bytes=staging_bytes)
            for r in range(engine.num_ranks)], mine


@pytest.fixture
def stopper() -> Iterator[list[Any]]:
    things: list[Any] = []
    yield things
    for t in things:
        t.stop() if isinstance(t, Child) else t.close()


def test_pull_tp2_to_tp1_across_processes(stopper: list[Any]) -> None:
    """Child: P TP2 serving pulls. Parent: D TP1 pulling (both modes, one after the other)."""
    pair, request = _pair(2, 1)
    child, eps, d_caches, links = _connected(pair, request, "prefill", stopper)
    plan = plan_pair(pair, request)
    for i, mode in enumerate(("coalesced", "prepped")):
        child.send("serve_pull", f"r{i}", mode, 20.0)
        results = wait_all([lk.pull(f"r{i}", request, plan=plan, mode=mode, timeout_s=20) for lk in links],
                           peers=eps)
        served = child.recv("done", 30)[1]
        assert [r["kind"] for r in served] == ["serve_pull", "serve_pull"]
        assert sum(r["bytes_moved"] for r in served) == sum(r.bytes_moved for r in results) == plan.bytes_copied
        violations, checked = check_caches(pair, request, d_caches)
        assert violations == [] and checked == sum(r.nbytes for r in pair.decode.regions)
        fill_caches(pair, request, allocate_caches(pair.prefill, "cpu"), d_caches)  # restale D for the next mode


def test_push_tp1_to_tp2_across_processes(stopper: list[Any]) -> None:
    """Child: D TP2 accepting pushes (it checks its own bytes). Parent: P TP1 pushing."""
    pair, request = _pair(1, 2)
    child, eps, _, links = _connected(pair, request, "decode", stopper)
    plan = plan_pair(pair, request)
    child.send("accept_push", "p1", "coalesced", 20.0)
    pushed = wait_all([lk.push("p1", request, plan=plan, timeout_s=20) for lk in links], peers=eps)
    _, accepted, verdict = child.recv("done", 30)
    assert sum(r.bytes_moved for r in pushed) == plan.bytes_copied
    assert sorted(r["rank"] for r in accepted) == [0, 1]
    assert sum(r["bytes_zeroed"] for r in accepted) == plan.bytes_zeroed
    n_violations, checked, first = verdict
    assert n_violations == 0, first
    assert checked == pair.decode.tp * sum(r.nbytes for r in pair.decode.regions)


def test_prefill_process_killed_mid_transfer(stopper: list[Any]) -> None:
    """The child P process dies (os._exit) while a pull is posted: a typed failure, fast, no hang."""
    pair, request = _pair(2, 1)
    child, eps, d_caches, links = _connected(pair, request, "prefill", stopper)
    plan = plan_pair(pair, request)
    # the child waits on the pipe and does not poll NIXL: the pull waits for P's grant
    t = links[0].pull("doomed", request, plan=plan, timeout_s=30)
    for _ in range(20):
        eps[0].progress()
    assert t.state == "posted" and t.handles == [] and len(t.contacted) == 2
    handles = list(t.handles)
    child.send("die")
    child.proc.join(10)
    assert child.proc.exitcode == 0
    start = time.perf_counter()
    with pytest.raises(TransferFailed) as ei:
        t.wait(peers=eps)
    elapsed = time.perf_counter() - start
    e = ei.value
    assert e.reason == "peer_disconnected", str(e)
    assert elapsed < 1.0, elapsed  # the heartbeat: NIXL refuses a ping to the dead peer, long before 30 s
    assert e.invalid_blocks == {0: request.groups[0].decode.block_ids}  # type: ignore[union-attr]
    assert all(h._released for h in handles) and not eps[0].in_flight
    # a new request to the dead peer fails while posting, also typed
    with pytest.raises(TransferFailed) as ei2:
        links[0].pull("after", request, plan=plan, timeout_s=5).wait(peers=eps)
    assert ei2.value.reason == "peer_disconnected"
    # the receive steps never ran: the zeros of the tail are missing, which is why the failure
    # hands the blocks back as invalid (whatever bytes the READ managed to land)
    violations, _ = check_caches(pair, request, d_caches)
    kinds = {v.kind.value for v in violations}
    assert "not_zeroed" in kinds and kinds <= {"not_zeroed", "missing", "wrong_data"}, kinds


def test_an_eager_pull_whose_p_process_dies_fails_fast_and_fences(stopper: list[Any]) -> None:
    """An eager pull (docs/design.md §8.1) READs at once, from a P process that does not progress
    NIXL (it waits on the pipe): the READs stay posted and no ``held`` comes. The process dies: the
    pull fails ``peer_disconnected`` within a second, and its READ handles are released (fenced),
    so D's blocks may be reused: a dead P, unlike a hung one, does not keep D's blocks."""
    pair, request = _pair(2, 1)
    child, eps, d_caches, links = _connected(pair, request, "prefill", stopper)
    plan = plan_pair(pair, request)
    t = links[0].pull("eager-doomed", request, plan=plan, timeout_s=30, eager=True)
    for _ in range(20):
        eps[0].progress()
    assert t.nixl_requests == 2  # posted in D's first progress, one READ per P rank
    assert not t.settled and t.granted == set(t.peers) and not t.confirmed
    handles = list(t.handles)
    child.send("die")
    child.proc.join(10)
    start = time.perf_counter()
    with pytest.raises(TransferFailed) as ei:
        t.wait(peers=eps)
    assert ei.value.reason == "peer_disconnected", str(ei.value)
    assert time.perf_counter() - start < 1.0
    assert ei.value.invalid_blocks == {0: request.groups[0].decode.block_ids}  # type: ignore[union-attr]
    deadline = time.perf_counter() + 10
    while not t.fenced:
        eps[0].progress()
        assert time.perf_counter() < deadline, f"still fencing on {t.handles} / {t.touching}"
    assert all(h._released for h in handles) and not eps[0].in_flight and not eps[0].fencing


def test_pull_from_two_pipeline_stages_across_processes(stopper: list[Any]) -> None:
    """Child: P PP2 x TP1 (rank 0 = layers 0-1, rank 1 = layers 2-3) serving pulls. Parent: D TP2 pulling."""
    m = ModelSpec("m", [AttentionSpec("attn", "full", 4, 4, 128)])
    pair = Pair(EngineGeometry.build(m, tp=1, kernel_block_tokens=16, num_blocks=16, name="prefill",
                                     topology=Topology(pp=2)),
                EngineGeometry.build(m, tp=2, kernel_block_tokens=8, num_blocks=32, name="decode", layout="NHD"))
    request = fresh_request(pair, 190, prefill_first_block=1, decode_first_block=3)
    child, eps, d_caches, links = _connected(pair, request, "prefill", stopper)
    plan = plan_pair(pair, request)
    assert [plan.sources_of(d) for d in range(2)] == [(0, 1), (0, 1)] and plan.consumers().tolist() == [2, 2]
    child.send("serve_pull", "pp", "coalesced", 20.0)
    results = wait_all([lk.pull("pp", request, plan=plan, timeout_s=20) for lk in links], peers=eps)
    served = child.recv("done", 30)[1]
    assert [r.nixl_requests for r in results] == [2, 2]  # one request per P stage
    assert sorted(r["rank"] for r in served) == [0, 1]
    # each stage served its 2 layers: tokens x 2 layers x 2 planes x 4 heads x 128 B in total over both D ranks
    assert [r["bytes_moved"] for r in sorted(served, key=lambda r: r["rank"])] == [190 * 2 * 2 * 4 * 128] * 2
    violations, checked = check_caches(pair, request, d_caches)
    assert violations == [] and checked == 2 * sum(r.nbytes for r in pair.decode.regions)


def test_push_from_dcp_ranks_across_processes(stopper: list[Any]) -> None:
    """Child: D TP1 MLA accepting pushes (it checks its own bytes). Parent: P TP2 DCP2, each rank
    pushing the tokens it holds (even ones on rank 0, odd ones on rank 1, interleave 1)."""
    m = ModelSpec("mla", [AttentionSpec("mla", "mla", 2, 1, 128)])
    pair = Pair(EngineGeometry.build(m, tp=2, kernel_block_tokens=8, num_blocks=16, name="prefill",
                                     topology=Topology(dcp=2)),
                EngineGeometry.build(m, tp=1, kernel_block_tokens=16, num_blocks=16, name="decode"))
    request = fresh_request(pair, 75, prefill_first_block=1, decode_first_block=2)
    child, eps, _, links = _connected(pair, request, "decode", stopper)
    plan = plan_pair(pair, request)
    assert plan.sources_of(0) == (0, 1)
    child.send("accept_push", "dcp", "coalesced", 20.0)
    pushed = wait_all([lk.push("dcp", request, plan=plan, timeout_s=20) for lk in links], peers=eps)
    _, accepted, verdict = child.recv("done", 30)
    # 38 even and 37 odd tokens of 75, 2 layers of 128 B latents
    assert sorted(r.bytes_moved for r in pushed) == [37 * 2 * 128, 38 * 2 * 128]
    assert [r["rank"] for r in accepted] == [0]
    n_violations, checked, first = verdict
    assert n_violations == 0, first
    assert checked == sum(r.nbytes for r in pair.decode.regions)


PACKED_SLOT = 64 << 10  # a chunk of the request below stages at most 64 KiB on a rank: several chunks


def test_packed_pull_across_processes_then_the_prefill_process_dies(stopper: list[Any]) -> None:
    """Child: P TP2 with staging rings, serving a packed pull in several chunks; then it dies while a
    second packed pull waits for its first chunk: the pull fails at its deadline and frees its slots."""
    pair, request = _pair(2, 1)
    child, eps, d_caches, links = _connected(pair, request, "prefill", stopper, PACKED_SLOT)
    plan = links[0].plan(request, strategy="packed")
    assert len(plan.chunks) >= 3 and len(plan.wire) <= 2 * len(plan.chunks)
    child.send("serve_pull", "k1", "coalesced", 20.0, "packed")
    results = wait_all([lk.pull("k1", request, plan=plan, timeout_s=20) for lk in links], peers=eps)
    served = child.recv("done", 30)[1]
    assert sum(r["bytes_moved"] for r in served) == sum(r.bytes_moved for r in results) == plan.bytes_copied
    assert sum(r.descriptors for r in results) == len(plan.wire) and sum(r["chunks"] for r in served) >= 3
    assert check_caches(pair, request, d_caches)[0] == []
    t = links[0].pull("k2", request, plan=plan, timeout_s=2.0)  # slots announced; the child does not serve
    child.send("die")
    child.proc.join(10)
    with pytest.raises(TransferFailed) as ei:
        t.wait(peers=eps)
    assert ei.value.reason in ("timeout", "peer_disconnected") and not eps[0].in_flight
    time.sleep(0.05)
    assert eps[0].staging is not None and eps[0].staging.free() == eps[0].staging.slots


def test_packed_push_across_processes(stopper: list[Any]) -> None:
    """Child: D TP2 with staging rings accepting a packed push (it checks its own bytes)."""
    pair, request = _pair(1, 2)
    child, eps, _, links = _connected(pair, request, "decode", stopper, PACKED_SLOT)
    plan = links[0].plan(request, strategy="packed")
    assert len(plan.chunks) >= 2
    child.send("accept_push", "k3", "coalesced", 20.0, "packed")
    pushed = wait_all([lk.push("k3", request, plan=plan, timeout_s=20) for lk in links], peers=eps)
    _, accepted, verdict = child.recv("done", 30)
    assert sum(r.bytes_moved for r in pushed) == plan.bytes_copied and sum(r.pack_s > 0 for r in pushed) == 1
    assert sum(r["bytes_zeroed"] for r in accepted) == plan.bytes_zeroed
    assert verdict[0] == 0, verdict[2]


def test_packed_pull_from_two_pipeline_stages_across_processes(stopper: list[Any]) -> None:
    """Child: P PP2 x TP1 with staging rings serving a packed pull; each stage packs only its layers
    (docs/design.md §11, §12). Parent: D TP2 pulling one wire row per (stage, D rank) and chunk."""
    m = ModelSpec("m", [AttentionSpec("attn", "full", 4, 4, 128)])
    pair = Pair(EngineGeometry.build(m, tp=1, kernel_block_tokens=16, num_blocks=16, name="prefill",
                                     topology=Topology(pp=2)),
                EngineGeometry.build(m, tp=2, kernel_block_tokens=8, num_blocks=32, name="decode", layout="NHD"))
    request = fresh_request(pair, 190, prefill_first_block=1, decode_first_block=3)
    child, eps, d_caches, links = _connected(pair, request, "prefill", stopper, PACKED_SLOT)
    plan = links[0].plan(request, strategy="packed")
    assert len(plan.chunks) >= 2 and set(zip(plan.wire.p_rank.tolist(), plan.wire.d_rank.tolist())) == \
        {(0, 0), (0, 1), (1, 0), (1, 1)}
    child.send("serve_pull", "pp-packed", "coalesced", 20.0, "packed")
    results = wait_all([lk.pull("pp-packed", request, plan=plan, timeout_s=20) for lk in links], peers=eps)
    served = child.recv("done", 30)[1]
    # each stage served its 2 layers: tokens x 2 layers x 2 planes x 4 heads x 128 B over both D ranks
    assert [r["bytes_moved"] for r in sorted(served, key=lambda r: r["rank"])] == [190 * 2 * 2 * 4 * 128] * 2
    assert sum(r.descriptors for r in results) == len(plan.wire)
    violations, checked = check_caches(pair, request, d_caches)
    assert violations == [] and checked == 2 * sum(r.nbytes for r in pair.decode.regions)


@pytest.mark.parametrize("mode", ["push", "packed push", "packed pull"])
def test_a_killed_peer_fails_every_mode_within_a_second(stopper: list[Any], mode: str) -> None:
    """Issue 19: after a SIGKILL of P only direct pulls failed fast (NIXL's READ reports the dead peer);
    an accept_push or a packed pull waited its whole deadline. The heartbeat (a ping every 0.1 s to
    each peer a transfer waits on; NIXL refuses a send to a dead one) fails each mode in < 1 s."""

    pair, request = _pair(2, 1)
    packed = mode.startswith("packed")
    child, eps, _, links = _connected(pair, request, "prefill", stopper, PACKED_SLOT if packed else 0)
    plan = links[0].plan(request, strategy="packed") if packed else plan_pair(pair, request)
    if mode.endswith("pull"):
        t = links[0].pull("gone", request, plan=plan, timeout_s=20)
    else:
        t = links[0].accept_push("gone", request, plan=plan, timeout_s=20)
    for _ in range(20):
        eps[0].progress()
    assert not t.settled
    child.proc.kill()  # SIGKILL
    child.proc.join(10)
    start = time.perf_counter()
    with pytest.raises(TransferFailed) as ei:
        t.wait(peers=eps)
    elapsed = time.perf_counter() - start
    assert ei.value.reason == "peer_disconnected" and elapsed < 1.0, (ei.value, elapsed)
    deadline = time.perf_counter() + 5
    while eps[0].fencing:  # the dead peer can touch nothing: every fence lifts
        eps[0].progress()
        assert time.perf_counter() < deadline
    if packed:
        assert eps[0].staging is not None and eps[0].staging.free() == eps[0].staging.slots


# ---- a packed WRITE half sent when P stops (issue 19, row 4) -------------------------------------------

HALF_MODEL = ModelSpec("big", [AttentionSpec("attn", "full", 4, 8, 256)])  # 16 KiB of K and V per token
HALF_TOKENS = 2048  # 32 MiB: two chunks of 16 MiB, far more than loopback TCP buffers in flight
HALF_SLOT = 16 << 20
SENTINEL = 0xEE


def _half_pair() -> tuple[Pair, Request]:
    pair = Pair(EngineGeometry.build(HALF_MODEL, tp=1, kernel_block_tokens=16, num_blocks=136, name="prefill",
                                     layout="NHD"),
                EngineGeometry.build(HALF_MODEL, tp=1, kernel_block_tokens=16, num_blocks=136, name="decode"))
    return pair, fresh_request(pair, HALF_TOKENS, prefill_first_block=3, decode_first_block=5)


def _timer_fence(monkeypatch: pytest.MonkeyPatch) -> None:
    """The control: the fence before issue 19, a timer (0.3 s after the failure) frees every slot of a
    failed packed transfer, whether or not the peer may still write into it."""
    from kvgeom_nixl.packed import PackedTransfer

    failed_at: dict[int, float] = {}

    def advance_slots(self: Any) -> None:
        start = failed_at.setdefault(id(self), time.perf_counter())
        if time.perf_counter() - start > 0.3:
            for ch in self.chunks:
                if ch.slot >= 0:
                    self.buffer.release(ch.slot)
                    ch.slot, ch.touching = -1, set()
        self._union_touching()

    monkeypatch.setattr(PackedTransfer, "_advance_slots", advance_slots)


def _half_sent_write(stopper: list[Any], monkeypatch: pytest.MonkeyPatch) -> tuple[Child, Any]:
    """P (a child process) pushes a packed request of two 16 MiB chunks to D (this process) over UCX
    TCP, where data moves only as the two workers progress; P is stopped (SIGSTOP) as soon as the
    first bytes land in D's staging slot. D's accept times out; D posts request R2 while P stays
    stopped; then P resumes (SIGCONT) and pushes R2. Returns the child and D's endpoint; asserts the
    fence: while P is stopped (and until P's WRITE has finished or P said its attempt ended) no slot
    the half-sent WRITE may still write is handed back or granted to R2."""
    import signal

    monkeypatch.setenv("UCX_TLS", "tcp")  # both processes (the child inherits it at spawn)
    pair, request = _half_pair()
    child, eps, d_caches, links = _connected(pair, request, "prefill", stopper, HALF_SLOT)
    ep, link = eps[0], links[0]
    plan = link.plan(request, strategy="packed")
    assert len(plan.chunks) == 2 and ep.staging is not None
    ring = ep.staging
    ring.tensor.fill_(SENTINEL)
    ends = {c: int((plan.wire.d_offset + plan.wire.nbytes)[plan.wire.chunk == c].max()) for c in range(len(plan.chunks))}

    def landed(slot: int, lo: int, hi: int) -> bool:
        return bool((ring.view(slot)[lo:hi] != SENTINEL).any())

    t1 = link.accept_push("r1", request, plan=plan, timeout_s=120)
    child.send("push", "r1", "coalesced", 120.0, "packed")
    stopped = False
    try:
        deadline = time.perf_counter() + 60
        while not any(landed(s, 0, 4096) for s in range(ring.slots)):  # the first bytes of a chunk
            ep.progress()
            assert time.perf_counter() < deadline and not t1.settled, "P's WRITE never started"
        os.kill(child.proc.pid, signal.SIGSTOP)  # P hangs with its WRITE in flight
        stopped = True
        until = time.perf_counter() + 1.0
        while time.perf_counter() < until:  # D drains what the sockets hold
            ep.progress()
        owners = {s: o for s, o in enumerate(ring.owner) if o is not None}
        half = [s for s, (_, c) in owners.items() if landed(s, 0, 4096) and not landed(s, ends[c] - 4096, ends[c])]
        assert half, f"no WRITE is half sent (slots {owners}): the scenario did not happen"

        def fence_holds() -> bool:  # a half-written slot is owned by r1 until its WRITE's bytes have all landed
            return all(ring.owner[s] == owners[s] or landed(s, ends[owners[s][1]] - 4096, ends[owners[s][1]])
                       for s in half)

        with pytest.raises(TransferFailed) as ei:
            t1.wait(timeout_s=0.2)  # D's accept times out
        assert ei.value.reason == "timeout"
        t2 = link.accept_push("r2", request, plan=plan, timeout_s=120)  # R2 asks for slots while P is stopped
        until = time.perf_counter() + 1.0
        while time.perf_counter() < until:
            ep.progress()
            assert fence_holds(), f"fence broken: a half-written slot was handed back while P is stopped ({ring.owner})"
        assert not t1.fenced and ep.fencing == (t1,) and not t2.settled
        os.kill(child.proc.pid, signal.SIGCONT)
        stopped = False
        assert child.recv("failed", 60)[1] == "aborted"  # P learned D's cancel: its attempt is not done
        child.send("push", "r2", "coalesced", 120.0, "packed")  # (P progresses again: its old WRITE moves on)
        deadline = time.perf_counter() + 60
        while not t2.settled:  # D's slots come back once P's WRITE finished (landed) or P said "ended"
            ep.progress()
            assert fence_holds(), f"fence broken: a half-written slot was handed back before its WRITE ended ({ring.owner})"
            assert time.perf_counter() < deadline, (t1, t2, ring.owner)
        assert t1.fenced and t2.done, t2.failure
        assert child.recv("done", 60)[0] == "done"
    finally:
        if stopped:
            os.kill(child.proc.pid, signal.SIGCONT)
    violations, _ = check_caches(pair, request, d_caches, max_per_kind=None)
    assert violations == [], [str(v) for v in violations[:3]]  # R2: every D byte right
    return child, ep


def test_a_half_sent_packed_write_keeps_its_slot_fenced_over_tcp(stopper: list[Any], monkeypatch: pytest.MonkeyPatch,
                                                                 capfd: pytest.CaptureFixture[str]) -> None:
    child, ep = _half_sent_write(stopper, monkeypatch)
    child.send("status")
    status = child.recv("status", 30)[1]
    assert status["posted"] >= 3 and status["unreleased"] == 0, status  # r1's WRITE(s) and r2's two: all released
    assert status["in_flight"] == status["fencing"] == 0 and status["slots_free"] == status["slots"], status
    assert not ep.in_flight and not ep.fencing and ep.staging is not None and ep.staging.free() == ep.staging.slots
    child.stop()
    ep.close()
    err = capfd.readouterr().err
    assert "finalization failed" not in err and "leak" not in err.lower(), err[-2000:]  # NIXL's words at close


def test_a_timer_fence_fails_the_half_sent_write_check(stopper: list[Any], monkeypatch: pytest.MonkeyPatch) -> None:
    """The control: with slots freed on a timer (the fence before issue 19) the same run hands the
    half-written slot back while P may still write into it, and the check above says so."""
    _timer_fence(monkeypatch)
    with pytest.raises(AssertionError, match="fence broken"):
        _half_sent_write(stopper, monkeypatch)
