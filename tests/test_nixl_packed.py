"""Packed plans through real NIXL agents in one process (docs/design.md §12.5): staging rings,
pipelined chunks, pull and push, the slot protocol, and failures that free every slot.

Every successful case fills P with the simulator's coordinate hashes and D with its stale pattern
and checks every D byte with ``kvgeom.checking.check_decode``. The fault-injection run drives 1,000
small requests through timeouts, cancellations, abandoned transfers and dead peers, and ends with
every slot of every ring free and every caller tensor unchanged outside its request's pages.
"""

from __future__ import annotations

import os
import time
from typing import Any

import numpy as np
import pytest

os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
os.environ.setdefault("UCX_NET_DEVICES", "lo")
from nixl_env import NIXL_API  # noqa: E402

pytest.importorskip(NIXL_API, reason="nixl is not installed (pip install 'kvgeom[nixl]')")
pytest.importorskip("torch", reason="torch is not installed (pip install 'kvgeom[nixl]')")

import torch  # noqa: E402

from kvgeom import (  # noqa: E402
    AttentionSpec,
    EngineGeometry,
    ModelSpec,
    Pair,
    Request,
    StagingCapacityError,
    TransferPlan,
    fresh_request,
    min_staging_bytes,
)
from kvgeom.building import get_preset  # noqa: E402
from kvgeom.checking import writable_pages  # noqa: E402
from kvgeom_nixl import (  # noqa: E402
    Endpoint,
    ExecutorError,
    HandshakeError,
    TransferFailed,
    decode_rank,
    encode_rank,
    wait_all,
)
from kvgeom_nixl.local import (  # noqa: E402
    LocalDeployment,
    allocate_caches,
    check_caches,
    fill_caches,
    slot_bytes_for,
)
from kvgeom_nixl.protocol import encode  # noqa: E402
from kvgeom_nixl.testing import requested_device, run_local  # noqa: E402

DEVICE = requested_device()


def _model(layers: int = 2) -> ModelSpec:
    return ModelSpec("m", [AttentionSpec("attn", "full", layers, 4, 64)])


def _pair(p: dict[str, Any], d: dict[str, Any], *, blocks: int = 16, layers: int = 2) -> Pair:
    m = _model(layers)
    return Pair(EngineGeometry.build(m, num_blocks=blocks, name="prefill", **p),
                EngineGeometry.build(m, num_blocks=blocks, name="decode", **d))


def _case(name: str) -> tuple[Pair, Request]:
    if name == "tp2 nhd k8 -> tp1 hnd k16":
        pair = _pair({"tp": 2, "kernel_block_tokens": 8, "layout": "NHD"}, {"tp": 1, "kernel_block_tokens": 16})
        return pair, fresh_request(pair, 100, prefill_first_block=1, decode_first_block=2)
    if name == "tp1 hnd k16 split -> tp2 nhd k8 inner, prefix":
        pair = _pair({"tp": 1, "kernel_block_tokens": 16, "kv": "split"},
                     {"tp": 2, "kernel_block_tokens": 8, "layout": "NHD", "kv": "inner"}, blocks=32)
        return pair, fresh_request(pair, 90, prefix_hit_tokens=24)
    if name.startswith("cpu_attn"):  # per-plane pages (docs/design.md §3.5): K transposed per block size
        isa = "amx" if "amx" in name else "vec"
        m = ModelSpec("m", [AttentionSpec("attn", "full", 2, 4, 128)], dtype="bfloat16" if isa == "amx" else "float32")
        bp, bd, d_tp = (32, 64, 2) if isa == "vec" else (96, 32, 1)
        pair = Pair(EngineGeometry.build(m, tp=1, num_blocks=12, name="prefill", kernel_block_tokens=bp, layout="CPU_ATTN",
                                         cpu_isa=isa),
                    EngineGeometry.build(m, tp=d_tp, num_blocks=12, name="decode", kernel_block_tokens=bd,
                                         layout="CPU_ATTN", cpu_isa=isa))
        return pair, fresh_request(pair, 150, prefix_hit_tokens=bd, prefill_first_block=1, decode_first_block=2)
    preset, tokens, layers = {
        "preset gqa-tp2-tp4": ("gqa-tp2-tp4", None, None),
        "preset qwen-swa-tp2-tp4 (sliding)": ("qwen-swa-tp2-tp4", 300, 2),
        "preset deepseek-v3 mla tp8->tp1": ("deepseek-v3-tp8-tp1", 100, 2),
        "preset nemotron-h tp1->tp4 (hybrid)": ("nemotron-h-tp1-tp4", 100, 1),
        "preset kimi-linear tp8->tp1 (hybrid)": ("kimi-linear-tp8-tp1", 1000, 1),
    }[name]
    return get_preset(preset).build(tokens, prefix=0, layers=layers)


CASES = ["tp2 nhd k8 -> tp1 hnd k16", "tp1 hnd k16 split -> tp2 nhd k8 inner, prefix", "preset gqa-tp2-tp4",
         "preset qwen-swa-tp2-tp4 (sliding)", "preset deepseek-v3 mla tp8->tp1",
         "preset nemotron-h tp1->tp4 (hybrid)", "preset kimi-linear tp8->tp1 (hybrid)",
         "cpu_attn vec k32 -> tp2 k64, prefix", "cpu_attn amx k96 -> k32, prefix"]


def _check(out: dict[str, Any], pair: Pair, push: bool) -> None:
    plan: TransferPlan = out["plan"]
    assert out["violations"] == [], [str(v) for v in out["violations"]]
    results = out["results"]
    initiators = [r for r in results if r.kind == ("push" if push else "pull")]
    assert sum(r.bytes_moved for r in initiators) == plan.wire.total_bytes == plan.bytes_copied
    assert sum(r.descriptors for r in initiators) == len(plan.wire)  # one descriptor per wire row
    assert sum(r.nixl_descs for r in initiators) == len(plan.wire)
    assert len(plan.wire) <= pair.prefill.num_ranks * pair.decode.num_ranks * len(plan.chunks)
    assert sum(r.bytes_zeroed for r in results if r.role == "decode") == plan.bytes_zeroed
    assert {r.chunks for r in initiators} <= set(range(len(plan.chunks) + 1))


@pytest.mark.parametrize("chunked", [False, True], ids=["one chunk", "chunks"])
@pytest.mark.parametrize("push", [False, True], ids=["pull", "push"])
@pytest.mark.parametrize("case", CASES)
def test_packed_transfer_lands_every_byte(case: str, push: bool, chunked: bool) -> None:
    pair, request = _case(case)
    plan = pair.plan(request, strategy="packed")
    if chunked:  # a third of the busiest rank's staging: the request in several chunks
        busiest = max(int(plan.staging_used(side).max()) for side in ("prefill", "decode"))
        plan = pair.plan(request, strategy="packed",
                         staging_bytes=max(min_staging_bytes(pair, request), busiest // 3))
    assert plan.packed and (len(plan.chunks) > 1) == chunked
    out = run_local(pair, request, push=push, device=DEVICE, telemetry=True, plan=plan)
    _check(out, pair, push)


def test_chunks_are_pipelined_through_two_slots() -> None:
    """P packs chunk 1 into its second slot while chunk 0 is still waiting to be read."""
    pair, request = _case("tp2 nhd k8 -> tp1 hnd k16")
    plan = pair.plan(request, strategy="packed", staging_bytes=4 * min_staging_bytes(pair, request))
    assert len(plan.chunks) >= 4
    p_caches, d_caches = allocate_caches(pair.prefill, DEVICE), allocate_caches(pair.decode, DEVICE)
    fill_caches(pair, request, p_caches, d_caches)
    seen: set[tuple[int, ...]] = set()
    with LocalDeployment(pair, p_caches, d_caches, staging_bytes=slot_bytes_for(plan)) as dep:
        ts = dep.post("pipe", request, plan)
        while not all(t.settled for t in ts):
            for ep in dep.d + dep.p:  # D first: it announces slots; then P packs
                ep.progress()
                if ep.role == "prefill" and ep.staging is not None:
                    seen.add(tuple(sorted(o[1] for o in ep.staging.owner if o is not None)))
        wait_all(ts)
        assert all(ep.staging is not None and ep.staging.free() == 2 for ep in dep.endpoints)
    assert (0, 1) in seen  # chunks 0 and 1 held at once on a P rank: packed ahead of the wire
    assert check_caches(pair, request, d_caches)[0] == []


def test_handshake_advertises_the_staging_ring() -> None:
    pair, _ = _case("tp2 nhd k8 -> tp1 hnd k16")
    caches = allocate_caches(pair.decode, "cpu")
    with Endpoint(pair.decode, "decode", 0, caches[0], staging_bytes=1 << 16, staging_slots=3) as ep:
        info = decode_rank(ep.handshake())
        assert info.staging is not None and info.staging[1:] == (3 << 16, 0, 1 << 16, 3)
        assert info.staging[0] == ep.staging.addr if ep.staging else False
        import json

        doc = json.loads(ep.handshake())
        for field, value, match in (("slots", 1, "slots"), ("nbytes", 123, "nbytes"), ("extra", 1, "staging")):
            bad = dict(doc, staging=dict(doc["staging"], **{field: value}))
            with pytest.raises(HandshakeError, match=match):
                decode_rank(json.dumps(bad))
        plain = dict(doc)
        del plain["staging"]
        assert decode_rank(json.dumps(plain)).staging is None  # an endpoint without staging
        assert decode_rank(encode_rank(info)) == info


def test_a_packed_plan_needs_staging_on_both_sides() -> None:
    pair, request = _case("tp2 nhd k8 -> tp1 hnd k16")
    plan = pair.plan(request, strategy="packed")
    p_caches, d_caches = allocate_caches(pair.prefill, "cpu"), allocate_caches(pair.decode, "cpu")
    with LocalDeployment(pair, p_caches, d_caches) as dep:  # no staging buffers
        with pytest.raises(ExecutorError, match="staging buffer"):
            dep.d_links[0].pull("x", request, plan=plan)
        with pytest.raises(StagingCapacityError):
            dep.d_links[0].plan(request, strategy="packed")
    gqa, gqa_request = _case("preset gqa-tp2-tp4")
    assert gqa.plan(gqa_request, strategy="auto").packed
    with LocalDeployment(gqa, allocate_caches(gqa.prefill, "cpu"), allocate_caches(gqa.decode, "cpu")) as dep:
        link = dep.d_links[0]
        assert link.staging_bytes == 0 and not link.plan(gqa_request, strategy="auto").packed  # no rings: not packed
    with LocalDeployment(pair, p_caches, d_caches, staging_bytes=4096) as dep:  # slots too small
        t = dep.d_links[0].pull("y", request, plan=plan)
        with pytest.raises(TransferFailed) as ei:
            t.poll()
        assert ei.value.reason == "plan_error" and "slot" in str(ei.value)
        assert all(ep.staging is not None and ep.staging.free() == 2 for ep in dep.endpoints)


def test_a_slot_number_outside_the_peers_ring_is_refused() -> None:
    """A peer's notification is untrusted: "packed" naming slot 9 of a 2-slot ring fails the pull."""
    pair, request = _case("tp2 nhd k8 -> tp1 hnd k16")
    plan = pair.plan(request, strategy="packed")
    p_caches, d_caches = allocate_caches(pair.prefill, "cpu"), allocate_caches(pair.decode, "cpu")
    with LocalDeployment(pair, p_caches, d_caches, staging_bytes=slot_bytes_for(plan)) as dep:
        t = dep.d_links[0].pull("evil", request, plan=plan, timeout_s=5)
        d0 = dep.d[0].name

        def say(p: Any, kind: str, *args: int) -> None:  # a P rank's signed message for D's attempt
            p.rank_agent.send(d0, encode(p.inbox.keys[d0], p.name, d0, kind, "evil", t.nonce, 7, *args))

        for p in dep.p:  # both P ranks ask for chunk 0: D grants a slot
            say(p, "want", 0)
        for _ in range(50):
            for ep in dep.endpoints:
                ep.progress()
        for p in dep.p:  # both P ranks claim chunk 0 sits in slot 9
            say(p, "packed", 0, 9)
        with pytest.raises(TransferFailed) as ei:
            t.wait(peers=dep.endpoints)  # P's agents progress (their notifications go out); no P transfer
        assert ei.value.reason == "plan_error" and "slot 9" in str(ei.value)
        assert dep.d[0].staging is not None and dep.d[0].staging.free() == 2


def _snapshot(caches: list[list[torch.Tensor]]) -> list[list[np.ndarray]]:
    return [[t.cpu().numpy().copy() for t in regs] for regs in caches]


def _outside_unchanged(pair: Pair, request: Request, before: list[list[np.ndarray]],
                       d_caches: list[list[torch.Tensor]]) -> bool:
    """Every D byte outside the request's writable pages is as it was."""
    writable = writable_pages(pair.decode, request)
    for rank, regs in enumerate(d_caches):
        for region, t in enumerate(regs):
            now = t.cpu().numpy()
            mask = np.ones(now.size, bool)
            pages = writable.get(region)
            if pages is not None:
                mask[np.repeat(pages, pair.decode.regions[region].page_bytes)] = False
            if not np.array_equal(now[mask], before[rank][region][mask]):
                return False
    return True


FAULTS = ("ok", "ok", "timeout", "cancel_d", "cancel_p", "abandon", "ok_push", "cancel_push")


def test_a_thousand_requests_with_faults_end_with_every_slot_free() -> None:
    """120 packed requests, each a few chunks: successes, D-side timeouts (P never polled), D or P
    cancelling mid-transfer, abandoned transfers that only their deadline ends, pushes, and every
    12th a P rank that dies (its endpoint closed) mid-transfer. Every failure frees or quarantines
    its slots, every caller tensor keeps its bytes outside the request's pages, and at the end every
    slot of every ring is free."""
    pair, _ = _case("tp2 nhd k8 -> tp1 hnd k16")
    rng = np.random.default_rng(12)
    p_caches, d_caches = allocate_caches(pair.prefill, DEVICE), allocate_caches(pair.decode, DEVICE)
    base = fresh_request(pair, 40)
    fill_caches(pair, base, p_caches, d_caches)
    slot = 3 * min_staging_bytes(pair, base) * 2
    dep = LocalDeployment(pair, p_caches, d_caches, staging_bytes=slot, staging_grace_s=0.05)
    outcomes: dict[str, int] = {}
    reasons: dict[str, set[str]] = {}
    cancelled: dict[str, set[str]] = {}  # cancel faults: the reasons of the victim's peers
    abandoned: list[Any] = []
    verified = 0
    try:
        for i in range(120):  # (each request pays the fence's messages: 120 keep it well within CI's limit)
            tokens = int(rng.integers(8, 41))
            p0, d0 = int(rng.integers(0, 16 - 5 + 1)), int(rng.integers(0, 16 - 3 + 1))  # <= 5 P, 3 D blocks
            request = fresh_request(pair, tokens, prefill_first_block=p0, decode_first_block=d0)
            plan = pair.plan(request, strategy="packed", staging_bytes=slot // 2)
            fault = "dead_peer" if i % 12 == 11 else FAULTS[i % len(FAULTS)]
            check = fault in ("ok", "ok_push") and i % 6 == 0
            if check:
                fill_caches(pair, request, p_caches, d_caches)
            p_before, d_before = _snapshot(p_caches), _snapshot(d_caches)
            rid = f"q{i}"
            push = fault in ("ok_push", "cancel_push")
            if fault == "abandon":  # D pulls from P ranks that never serve it, and nobody waits
                ts = [lk.pull(rid, request, plan=plan, timeout_s=0.01) for lk in dep.d_links]
                abandoned += ts
            else:
                ts = dep.post(rid, request, plan, push=push, timeout_s=0.01 if fault == "timeout" else 5)
            d_ts = [t for t in ts if t.role == "decode"]
            if fault in ("ok", "ok_push"):
                wait_all(ts, peers=dep.endpoints)
            elif fault == "timeout":  # P is never polled: D's slots wait for "packed" until the deadline
                with pytest.raises(TransferFailed):
                    wait_all(d_ts, peers=dep.d)
                wait_all_settled(ts, dep)
            elif fault in ("cancel_d", "cancel_p", "cancel_push"):
                for ep in dep.d + dep.p[:1]:
                    ep.progress()  # part of the way
                victim = d_ts[0] if fault != "cancel_p" else [t for t in ts if t.role == "prefill"][0]
                victim.cancel("closed", "cancelled by the test")
                wait_all_settled(ts, dep)
                cancelled.setdefault(fault, set()).update(
                    t.failure.reason if t.failure else "done" for t in ts if t is not victim)
                assert victim.failure is not None and victim.failure.reason == "closed"
            elif fault == "abandon":
                pass  # its slots stay taken until later requests' progress calls end it at its deadline
            elif fault == "dead_peer":
                for ep in dep.d + dep.p:
                    ep.progress()
                dep.p[1].close()  # P rank 1 dies mid-transfer
                wait_all_settled(ts, dep)
                assert any(t.failure is not None for t in ts)
            outcomes[fault] = outcomes.get(fault, 0) + 1
            if fault != "abandon":
                reasons.setdefault(fault, set()).update(t.failure.reason for t in ts if t.failure is not None)
            assert all(np.array_equal(a, t.cpu().numpy()) for regs_a, regs_t in zip(p_before, p_caches, strict=True)
                       for a, t in zip(regs_a, regs_t, strict=True))  # P memory is only read
            assert _outside_unchanged(pair, request, d_before, d_caches), (i, fault)
            if check:
                assert check_caches(pair, request, d_caches)[0] == [], i
                verified += 1
            if fault == "dead_peer":  # a new deployment on the same caches, as an engine restart would
                _close_and_check(dep)
                dep = LocalDeployment(pair, p_caches, d_caches, staging_bytes=slot, staging_grace_s=0.05)
    finally:
        _close_and_check(dep)
    assert outcomes["dead_peer"] == 10 and outcomes["ok"] >= 20 and verified >= 5
    assert reasons["ok"] == reasons["ok_push"] == set()
    assert reasons["timeout"] >= {"timeout"} and reasons["timeout"] <= {"timeout", "aborted"}
    # a cancel ends every other side of the request "aborted" (docs/design.md §8.1): never done, never left
    # waiting for its deadline, whether the peer had heard of the cancelled attempt or not
    assert cancelled == {"cancel_d": {"aborted"}, "cancel_p": {"aborted"}, "cancel_push": {"aborted"}}, cancelled
    assert reasons["dead_peer"] and reasons["dead_peer"] <= {"closed", "aborted", "peer_disconnected", "nixl_error",
                                                             "timeout"}
    assert abandoned and all(t.failure is not None and t.failure.reason == "timeout" for t in abandoned)


def wait_all_settled(ts: list[Any], dep: LocalDeployment) -> None:
    """Drive every endpoint until every transfer of ``ts`` has settled (done or failed)."""
    deadline = time.perf_counter() + 10
    while not all(t.settled for t in ts):
        for ep in dep.endpoints:
            ep.progress()
        assert time.perf_counter() < deadline, [repr(t) for t in ts]


def _close_and_check(dep: LocalDeployment) -> None:
    """Settle what is in flight (abandoned transfers end at their deadline) and every fence (no timer
    frees a slot: each is freed once NIXL and the peer have let go of it), then every slot of every
    open ring must be free."""
    deadline = time.perf_counter() + 10
    while any(ep.in_flight or ep.fencing for ep in dep.endpoints if not ep.closed):
        for ep in dep.endpoints:
            ep.progress()
        assert time.perf_counter() < deadline, [ep.fencing for ep in dep.endpoints if not ep.closed]
    for ep in dep.endpoints:
        if ep.closed or ep.staging is None:
            continue
        assert ep.staging.free() == ep.staging.slots, (ep.name, ep.staging.owner)
    dep.close()
