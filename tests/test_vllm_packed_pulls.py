"""Packed pulls through the connector's executor (docs/design.md §15.3, kvgeom_nixl/vllm/packed_pulls.py):
D offers P the request it planned over the side channel, P plans the same packed plan and packs it.

Real NIXL between executors of this process (tests/test_vllm_e2e_units.py's ``Engines``); bytes
are checked against CPU_ATTN's page formula written out by hand there. The offers P must refuse
are built from a real D link (so each one is wrong in exactly one way) and sent on the real side
channel. The staging helper is checked against sizes worked out by hand.
"""

from __future__ import annotations

import hashlib
import time
from dataclasses import replace
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")
from nixl_env import NIXL_API  # noqa: E402

pytest.importorskip(NIXL_API, reason="kvgeom_nixl needs the nixl extra")

from test_vllm_e2e_units import Engines, assert_tokens_equal, caches, group, kv_at  # noqa: E402

from kvgeom import Pair, TransferPlan, plan_pair, request_from_block_tables  # noqa: E402
from kvgeom.tools import dumps  # noqa: E402
from kvgeom_nixl import staging_bytes_for  # noqa: E402
from kvgeom_nixl.errors import ExecutorError  # noqa: E402
from kvgeom_nixl.vllm.caches import geometry_from_kv_caches  # noqa: E402
from kvgeom_nixl.vllm.packed_pulls import plan_digest  # noqa: E402
from kvgeom_nixl.vllm.pulls import PACKED_SETUP_S, connector_costs  # noqa: E402
from kvgeom_nixl.vllm.side_channel import PackedOffer, SideChannelError, send_packed  # noqa: E402

SLOT = 1 << 20


def ids_for(m: int, block: int, first: int) -> list[int]:
    return list(range(first, first + -(-m // block)))


@pytest.mark.timeout(300)
@pytest.mark.parametrize("p_block, p_tp, d_block, d_tp", [
    (32, 1, 64, 1), (64, 1, 32, 1), (32, 1, 96, 1), (128, 1, 32, 1), (32, 1, 64, 2), (32, 2, 64, 1),
])
def test_a_packed_pull_moves_every_token_byte_exact(p_block: int, p_tp: int, d_block: int, d_tp: int) -> None:
    """Between CPU_ATTN block sizes auto packs (one copy per K dim and block otherwise): every D rank
    offers, every P rank it reads from plans the same plan and packs it; D's tokens equal P's, and
    both sides end with nothing kept (no send, offer, slot or pull)."""
    e = Engines(p_block, p_tp, d_block, d_tp, staging_bytes=SLOT)
    try:
        m = 517  # off every block boundary
        p_ids, d_ids = ids_for(m, p_block, 3), ids_for(m, d_block, 2)
        e.pull("r1", m, p_ids, d_ids)
        d_out, p_out = e.wait()
        assert all(r.finished_recving == {"d-r1"} and not r.failed for r in d_out), d_out
        assert all(r.finished_sending == {"r1"} for r in p_out), p_out
        assert_tokens_equal(e, range(m), p_ids, d_ids)
        assert [ex.counters().get("pulls packed", 0) for ex in e.d] == [1] * d_tp  # packed, not direct
        assert [ex.counters().get("packed offers accepted", 0) for ex in e.p] == [1] * p_tp
        for ex in [*e.p, *e.d]:
            c = ex.counters()
            assert c["offers"] == c["sends"] == c["pulls"] == c["staging_busy"] == c["in_flight"] == 0, c
    finally:
        e.close()


@pytest.mark.timeout(300)
@pytest.mark.parametrize("p_block, d_block, staging, setup_s, packed", [
    (32, 32, SLOT, 0.0, 0), (32, 64, 0, 0.0, 0), (32, 64, SLOT, PACKED_SETUP_S, 0), (32, 64, SLOT, 0.0, 1)])
def test_auto_packs_only_where_it_wins_and_a_ring_exists(p_block: int, d_block: int, staging: int, setup_s: float,
                                                         packed: int) -> None:
    """Equal block sizes move whole pages directly (2 copies beat any packing); without a staging
    ring auto never packs; with the connector's default setup cost a 100-token prompt moves directly
    (264 copies, 0.4 ms by the cost model, against 12 ms); the last cell is the control that the same
    request does pack when packing costs only its rows and operations."""
    e = Engines(p_block, 1, d_block, 1, staging_bytes=staging, packed_setup_s=setup_s)
    try:
        m = 100
        p_ids, d_ids = ids_for(m, p_block, 3), ids_for(m, d_block, 5)
        e.pull("r1", m, p_ids, d_ids)
        d_out, _ = e.wait()
        assert d_out[0].finished_recving == {"d-r1"} and not d_out[0].failed
        assert_tokens_equal(e, range(m), p_ids, d_ids)
        assert e.d[0].counters().get("pulls packed", 0) == packed
    finally:
        e.close()


# ---- offers P must refuse ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def linked() -> Any:
    """P (32-token blocks) and D (64) after one packed pull: the link exists on both sides."""
    e = Engines(32, 1, 64, 1, staging_bytes=SLOT)
    e.pull("warm", 100, ids_for(100, 32, 3), ids_for(100, 64, 5))
    d_out, _ = e.wait()
    assert d_out[0].finished_recving == {"d-warm"} and not d_out[0].failed
    yield e
    e.close()


def offer(e: Engines, rid: str, *, m: int = 100, staging: int = SLOT, plan_staging: int | None = None,
          sign: bool = True, **change: Any) -> PackedOffer:
    """D rank 0's offer of a fresh request ``rid``, signed on D's real link; ``change`` alters fields
    after signing (so each refusal below is wrong in one way only)."""
    link = e.d[0]._d_links["P"]
    request = request_from_block_tables(link.pair, m, (tuple(ids_for(m, 32, 3)),), (tuple(ids_for(m, 64, 5)),),
                                        decode_tokens=m, null_block=0)
    plan = plan_pair(link.pair, request, strategy="packed", staging_bytes=plan_staging or staging)
    o = PackedOffer("D", 0, 1, "", rid, dumps(request), staging, plan_digest(plan))
    agent, mac = link.sign_document(0, rid, hashlib.sha256(o.signed_bytes()).digest())
    o = replace(o, agent=agent, mac=mac if sign else "0" * 32)
    return replace(o, **change)


def test_a_well_formed_offer_is_accepted(linked: Engines) -> None:
    """The control for the refusals below: the same construction, unaltered, is accepted and kept."""
    send_packed("127.0.0.1", linked.port, offer(linked, "fine"), timeout_s=30)
    with linked.p[0].lock:
        assert "fine" in linked.p[0]._offers


@pytest.mark.parametrize("what, field", [
    ("unsigned", "packed.mac"),
    ("document changed after signing", "packed.mac"),
    ("staging changed after signing", "packed.mac"),
    ("another D rank claimed", "packed.d_rank"),
    ("another agent claimed", "packed.mac"),
    ("an engine P has no link with", "packed.engine"),
    ("digest not hex", "packed.digest"),
    ("staging not an int", "packed.staging_bytes"),
    ("a request id NIXL refuses", "packed.request"),
    ("an unsigned copy of an accepted offer", "packed.mac"),
])
def test_a_forged_or_altered_offer_is_refused_by_name(linked: Engines, what: str, field: str) -> None:
    o = {
        "unsigned": lambda: offer(linked, "f1", sign=False),
        "document changed after signing": lambda: replace(offer(linked, "f2"),
                                                          document=offer(linked, "f2", m=90).document),
        "staging changed after signing": lambda: replace(offer(linked, "f3"), staging_bytes=SLOT // 2),
        "another D rank claimed": lambda: replace(offer(linked, "f4"), d_rank=1),
        "another agent claimed": lambda: replace(offer(linked, "f5"), agent="someone-else"),
        "an engine P has no link with": lambda: replace(offer(linked, "f6"), engine="D-other"),
        "digest not hex": lambda: replace(offer(linked, "f7"), digest="z" * 64),
        "staging not an int": lambda: replace(offer(linked, "f8"), staging_bytes="1048576"),  # type: ignore[arg-type]
        "a request id NIXL refuses": lambda: offer(linked, "f9|x"),
        "an unsigned copy of an accepted offer": lambda: replace(accepted(linked, "f10"), agent="x", mac="0" * 32),
    }[what]()
    with pytest.raises(SideChannelError, match=field.replace(".", r"\.")):
        send_packed("127.0.0.1", linked.port, o, timeout_s=30)
    if what != "an unsigned copy of an accepted offer":
        with linked.p[0].lock:
            assert o.request not in linked.p[0]._offers


def accepted(e: Engines, rid: str) -> PackedOffer:
    """An offer P accepted (the refusal above is then of the copy, not of an unknown request)."""
    o = offer(e, rid)
    send_packed("127.0.0.1", e.port, o, timeout_s=30)
    return o


def test_an_offer_whose_plan_p_cannot_reproduce_is_refused(linked: Engines) -> None:
    """D's digest of a plan cut for 48 KiB slots, offered as cut for 1 MiB (signed as such): P plans
    1 MiB chunks, which differ, and refuses. The two digests differing is checked first, so the
    refusal cannot come from a digest check that compares nothing."""
    link = linked.d[0]._d_links["P"]
    m = 517
    request = request_from_block_tables(link.pair, m, (tuple(ids_for(m, 32, 3)),), (tuple(ids_for(m, 64, 5)),),
                                        decode_tokens=m, null_block=0)
    small = plan_pair(link.pair, request, strategy="packed", staging_bytes=48 << 10)
    big = plan_pair(link.pair, request, strategy="packed", staging_bytes=SLOT)
    assert len(np.unique(small.wire.chunk)) > len(np.unique(big.wire.chunk))
    assert plan_digest(small) != plan_digest(big)
    o = offer(linked, "d1", m=m, staging=SLOT, plan_staging=48 << 10)
    with pytest.raises(SideChannelError, match=r"packed\.digest"):
        send_packed("127.0.0.1", linked.port, o, timeout_s=30)


def test_an_offer_for_a_request_p_already_freed_is_refused(linked: Engines) -> None:
    """"warm" was pulled and freed: a replayed offer for it is refused (it would never be served)."""
    with pytest.raises(SideChannelError, match=r"packed\.request"):
        send_packed("127.0.0.1", linked.port, offer(linked, "warm"), timeout_s=30)


@pytest.mark.timeout(300)
def test_a_refused_offer_fails_the_pull_before_anything_moves(monkeypatch: pytest.MonkeyPatch) -> None:
    """P's planner cuts 48 KiB chunks where D's cut 1 MiB ones (as a planner of another version
    might): P refuses the offer (``packed.digest``), D's pull fails before posting with every listed
    D block invalid (vLLM recomputes them), D's blocks keep their bytes, and P frees the send on
    D's release, not on its lease."""
    import kvgeom_nixl.vllm.packed_pulls as pp

    real = pp.plan_pair
    monkeypatch.setattr(pp, "plan_pair", lambda pair, request, **kw: real(pair, request, **{**kw, "staging_bytes": 48 << 10}))
    e = Engines(32, 1, 64, 1, staging_bytes=SLOT)
    try:
        m = 517
        p_ids, d_ids = ids_for(m, 32, 3), ids_for(m, 64, 5)
        e.pull("r1", m, p_ids, d_ids)
        d_out, p_out = e.wait()
        assert d_out[0].finished_recving == {"d-r1"}
        assert d_out[0].failed == {"d-r1": {0: set(d_ids)}}
        assert p_out[0].finished_sending == {"r1"}
        assert np.all(kv_at(e.d_caches[0]["model.layers.0.self_attn.attn"], d_ids[0], 0, 0)[0] == -7.0)
        assert e.p[0].counters()["offers"] == 0 and e.p[0].counters().get("packed offers accepted", 0) == 0
        assert e.p[0].counters().get("freed released", 0) == 1
    finally:
        e.close()


def test_plan_digest_sees_every_row_and_step() -> None:
    """Equal plans digest equal; one wire row's offset, one pack's page, one unpack's staged offset
    changed each give another digest."""
    geo = {b: geometry_from_kv_caches(caches(b, 1), [group(b)], tp=1, name=f"e{b}")[0] for b in (32, 64)}
    pair = Pair(geo[32], geo[64])
    request = request_from_block_tables(pair, 100, ((3, 4, 5, 6),), ((5, 6),), decode_tokens=100, null_block=0)
    plan = plan_pair(pair, request, strategy="packed", staging_bytes=SLOT)
    again = plan_pair(pair, request, strategy="packed", staging_bytes=SLOT)
    assert plan.packs and plan.unpacks and len(plan.wire)
    assert plan_digest(plan) == plan_digest(again)
    w = plan.wire
    moved = type(w)(chunk=w.chunk, p_rank=w.p_rank, p_offset=w.p_offset + 1, d_rank=w.d_rank, d_offset=w.d_offset,
                    nbytes=w.nbytes)
    st = plan.packs[0]
    unp = plan.unpacks[0]
    variants: list[TransferPlan] = [
        _with(plan, wire=moved),
        _with(plan, packs=(_step(st, pages=st.pages + 1), *plan.packs[1:])),
        _with(plan, unpacks=(_step(unp, staged=unp.staged + 4), *plan.unpacks[1:])),
    ]
    assert len({plan_digest(v) for v in variants} | {plan_digest(plan)}) == 4


def _with(plan: TransferPlan, **kw: Any) -> TransferPlan:
    import attrs

    return attrs.evolve(plan, **kw)


def _step(st: Any, **kw: Any) -> Any:
    import attrs

    return attrs.evolve(st, **kw)


# ---- the staging helper -----------------------------------------------------------------------------


@pytest.mark.parametrize("tp, tokens, want", [
    (1, 2048, 4 << 20),  # 2 layers x 4 heads x 2 (K, V) x 32 dims x 4 B = 2 KiB a token
    (2, 2048, 2 << 20),  # half the heads on each rank
    (1, 10, 1 << 20),  # 20 KiB: the 1 MiB floor
    (1, 1 << 20, 64 << 20),  # 2 GiB: the 64 MiB cap
    (1, 2049, (4 << 20) + 4096),  # 4 MiB + 2 KiB, rounded up to a whole 4 KiB page
])
def test_staging_bytes_for_is_a_token_count_times_the_ranks_bytes_per_token(tp: int, tokens: int, want: int) -> None:
    geo, _ = geometry_from_kv_caches(caches(32, tp), [group(32)], tp=tp, name="e")
    assert staging_bytes_for(geo, 0, tokens) == want
    assert staging_bytes_for(geo, tp - 1, tokens) == want


def test_staging_bytes_for_refuses_a_rank_the_engine_lacks() -> None:
    geo, _ = geometry_from_kv_caches(caches(32, 2), [group(32)], tp=2, name="e")
    with pytest.raises(ExecutorError, match="rank"):
        staging_bytes_for(geo, 2, 100)


def test_the_staging_setting_takes_auto_or_a_byte_count() -> None:
    """``kv_connector_extra_config["staging_bytes"]``: absent or "auto" -> the helper for
    max_model_len; 0 -> no ring; bytes as given; anything else refused by name with the fix."""
    from kvgeom_nixl.vllm.worker import _staging_bytes

    geo, _ = geometry_from_kv_caches(caches(32, 1), [group(32)], tp=1, name="e")
    assert _staging_bytes({}, geo, 0, 2048) == _staging_bytes({"staging_bytes": "auto"}, geo, 0, 2048) == 4 << 20
    assert _staging_bytes({"staging_bytes": 0}, geo, 0, 2048) == 0
    assert _staging_bytes({"staging_bytes": 12345}, geo, 0, 2048) == 12345
    for bad in ("16", True, -1, 1.5, None, 1 << 41):
        with pytest.raises(ExecutorError, match="kv_connector_extra_config.staging_bytes"):
            _staging_bytes({"staging_bytes": bad}, geo, 0, 2048)


def test_offers_are_forgotten_with_their_send() -> None:
    """After 3 packed pulls P keeps no offer (each was dropped when its send was freed)."""
    e = Engines(32, 1, 64, 1, staging_bytes=SLOT)
    try:
        for i in range(3):
            e.pull(f"r{i}", 100, ids_for(100, 32, 3 + 4 * i), ids_for(100, 64, 5 + 2 * i))
            d_out, _ = e.wait()
            assert d_out[0].finished_recving == {f"d-r{i}"} and not d_out[0].failed
        deadline = time.monotonic() + 10
        while e.p[0].counters()["offers"] and time.monotonic() < deadline:
            time.sleep(0.05)
        assert e.p[0].counters()["offers"] == 0 and e.p[0].counters()["packed offers accepted"] == 3
    finally:
        e.close()


@pytest.mark.parametrize("m, setup_s, packed", [(517, 0.0, True), (517, PACKED_SETUP_S, False),
                                                (4096, PACKED_SETUP_S, True)])
def test_the_connectors_cost_model_packs_long_prompts_only(m: int, setup_s: float, packed: bool) -> None:
    """auto with :func:`connector_costs`, P block 32 -> D block 64 (tiny Llama, CPU_ATTN). By hand,
    at 517 tokens direct posts 4,472 copies (x 1.5 us = 6.7 ms) and packed 1 wire row, 2 x 1 MiB
    copied at 8 GB/s and 8 operations (0.43 ms): packed wins, until the 12 ms setup is added. At
    4096 tokens direct posts 33,666 copies (50.5 ms) against 2.2 ms + 12 ms packed."""
    geo = {b: geometry_from_kv_caches(caches(b, 1, blocks=200), [group(b)], tp=1, name=f"e{b}")[0] for b in (32, 64)}
    pair = Pair(geo[32], geo[64])
    request = request_from_block_tables(pair, m, (tuple(ids_for(m, 32, 3)),), (tuple(ids_for(m, 64, 2)),),
                                        decode_tokens=m, null_block=0)
    costs = connector_costs(setup_s)
    direct = plan_pair(pair, request, strategy="direct")
    pack = plan_pair(pair, request, strategy="packed", staging_bytes=8 << 20)
    assert len(direct.copies) == {517: 4472, 4096: 33666}[m]
    assert len(pack.wire) == 1 and pack.bytes_copied == m * 2048  # 2 layers x 4 heads x (K, V) x 32 dims x 4 B
    assert len(pack.packs) + len(pack.unpacks) == {517: 8, 4096: 4}[m]
    auto = plan_pair(pair, request, strategy="auto", cost_model=costs, staging_bytes=8 << 20)
    assert auto.packed is packed
    direct_s = costs.cost(len(direct.copies), 0)
    assert (direct_s > costs.packed_cost(1, pack.bytes_copied, len(pack.packs) + len(pack.unpacks))) is packed


def test_the_packed_setup_setting_takes_milliseconds() -> None:
    """``kv_connector_extra_config["packed_setup_ms"]``: absent -> 12 ms; numbers as given (in
    seconds for the executor); booleans, strings, negatives and more than a minute refused by name."""
    from kvgeom_nixl.vllm.worker import _packed_setup_s

    assert _packed_setup_s({}) == PACKED_SETUP_S == 12e-3
    assert _packed_setup_s({"packed_setup_ms": 0}) == 0.0 and _packed_setup_s({"packed_setup_ms": 2.5}) == 2.5e-3
    for bad in (True, "12", -1, 60_001, None):
        with pytest.raises(ExecutorError, match="kv_connector_extra_config.packed_setup_ms"):
            _packed_setup_s({"packed_setup_ms": bad})


@pytest.mark.timeout(300)
def test_one_d_rank_failing_before_it_posts_ends_its_siblings_pull_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """P TP1 -> D TP2: P packs the whole plan, whose chunks wait for both D ranks' req. D rank 1's
    offer fails (as when P's side channel is full), so it fails before posting and releases; P
    cancels the packed serve on that release, so D rank 0's pull fails now, not at its 60 s
    timeout (vLLM recomputes both), and P frees the send."""
    import kvgeom_nixl.vllm.pulls as pulls

    real = pulls.offer_packed

    def flaky(link: Any, request: Any, plan: Any, **kw: Any) -> list[int]:
        if kw["rank"] == 1:
            time.sleep(0.5)  # (after rank 0 posted: the case where its pull would wait)
            raise SideChannelError("side_channel", "P rank 0 refused packed: full")
        return real(link, request, plan, **kw)

    monkeypatch.setattr(pulls, "offer_packed", flaky)
    e = Engines(32, 1, 64, 2, staging_bytes=SLOT, pull_timeout_s=60.0)
    try:
        m = 100
        started = time.monotonic()
        e.pull("r1", m, ids_for(m, 32, 3), ids_for(m, 64, 5))
        d_out, p_out = e.wait(timeout_s=40)
        assert time.monotonic() - started < 30
        assert all(r.finished_recving == {"d-r1"} and "d-r1" in r.failed for r in d_out), d_out
        assert p_out[0].finished_sending == {"r1"}
        assert e.d[0].counters().get("pull failed aborted", 0) == 1, e.d[0].counters()
    finally:
        e.close()


def test_an_offer_whose_send_never_comes_is_forgotten(linked: Engines, monkeypatch: pytest.MonkeyPatch) -> None:
    """An accepted offer for a request P never gets a send is dropped after ``OFFER_TTL_S`` by the
    progress thread, with nothing else arriving (an idle rank keeps no offer)."""
    monkeypatch.setattr("kvgeom_nixl.vllm.holds.OFFER_TTL_S", 0.2)
    accepted(linked, "never-sent")
    deadline = time.monotonic() + 10
    while linked.p[0].counters()["offers"] and time.monotonic() < deadline:
        time.sleep(0.05)
    with linked.p[0].lock:
        assert not linked.p[0]._offers


@pytest.mark.timeout(300)
def test_a_packed_pull_after_ps_lease_fails_and_vllm_recomputes() -> None:
    """P's lease ends at once (0 s), before D has linked and planned: P refuses D's offer (the
    request is freed), so D's pull fails before posting, well before its 30 s timeout, with every
    listed D block invalid, and neither side keeps anything."""
    e = Engines(32, 1, 64, 1, staging_bytes=SLOT, lease_s=0.0, pull_timeout_s=30.0)
    try:
        m = 517
        started = time.monotonic()
        e.pull("r1", m, ids_for(m, 32, 3), ids_for(m, 64, 5))
        d_out, p_out = e.wait(timeout_s=25)
        assert time.monotonic() - started < 20
        assert d_out[0].finished_recving == {"d-r1"}
        assert d_out[0].failed == {"d-r1": {0: set(ids_for(m, 64, 5))}}, d_out
        assert p_out[0].finished_sending == {"r1"}
        c = e.p[0].counters()
        assert c["offers"] == c["sends"] == c["in_flight"] == 0 and c["freed lease expired"] == 1, c
        assert e.d[0].counters()["pull failed before posting"] == 1
    finally:
        e.close()
