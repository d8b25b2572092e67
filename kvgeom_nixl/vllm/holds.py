"""P's side of the connector's executor: pending sends, holds and frees, D engines' handshakes
(docs/design.md §15.4).

vLLM hands P's finished requests over as pending sends (:meth:`HoldSide.send`, with a lease). The
progress thread holds each one on the link of the D engine whose rank asked for it (``req``, or
the ``read`` of D's eager READ; ``link.hold``: P knows only its own blocks; ``link.serve_pull`` with
the plan of D's packed offer, :mod:`kvgeom_nixl.vllm.packed_pulls`), and frees it (``finished_sending``) once every D rank
released it over the side channel and its hold is over, or when its lease expires. The
side-channel threads collect a D engine's handshakes and connect once all its ranks arrived.

:class:`HoldSide` is a part of :class:`~kvgeom_nixl.vllm.executor.ConnectorExecutor` (which owns
the lock, the endpoints and the threads).
"""

from __future__ import annotations

import hashlib
import logging
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from kvgeom_nixl.endpoint import Endpoint, Link
from kvgeom_nixl.errors import ExecutorError
from kvgeom_nixl.packed import PackedTransfer
from kvgeom_nixl.transfer import Transfer

from .packed_pulls import MAX_OFFERS, OFFER_TTL_S, PlannedOffer, check_offer, plan_offer
from .pulls import Results
from .side_channel import PackedOffer, SideChannelError, SideChannelServer

__all__ = ["HoldSide", "MAX_COLLECTING", "MAX_SEEN"]

MAX_COLLECTING = 16  # D engines whose handshakes are being collected at once (hostile bound)
MAX_SEEN = 1 << 16  # P request ids remembered after they were freed (a late duplicate is ignored)


@dataclass
class _Send:
    """P: a finished request whose blocks wait for D."""

    expiry: float
    hold: Transfer | None = None
    closing: str = ""  # why it is being freed ("released", "lease expired", "hold ended")


@dataclass
class _Collect:
    """P: the handshakes of one D engine's ranks."""

    tp: int
    started: float
    payloads: dict[int, bytes] = field(default_factory=dict)
    digests: dict[int, bytes] = field(default_factory=dict)
    state: str = "collecting"  # collecting -> connecting -> linked | failed
    error: str = ""



class HoldSide:
    """P: the pending sends and D handshakes of a :class:`~kvgeom_nixl.vllm.executor.ConnectorExecutor`."""

    # (the executor's, set in its __init__)
    log: logging.Logger
    lock: Any
    rank: int
    handshake_timeout_s: float
    prefill: Endpoint | None
    outcomes: Counter[str]
    _p_links: dict[str, Link]
    _agent_engine: dict[str, str]
    _sends: dict[str, _Send]
    _seen: dict[str, None]
    _hs: dict[str, _Collect]
    _hs_cond: threading.Condition
    _offers: dict[str, PlannedOffer]
    _offers_pruned: float
    _out: Results
    _wake: threading.Event

    def _connect_link(self, ep: Endpoint, payloads: list[bytes]) -> Link:
        raise NotImplementedError  # the executor's

    # ---- the engine thread's call ----------------------------------------------------------
    def send(self, request_id: str, lease_s: float) -> None:
        """P: keep ``request_id``'s blocks for D for at most ``lease_s`` seconds."""
        with self.lock:
            if request_id in self._seen:  # (already pending, or freed: vLLM frees a request once)
                return
            self._seen[request_id] = None
            while len(self._seen) > MAX_SEEN:
                del self._seen[next(iter(self._seen))]
            self._sends[request_id] = _Send(time.monotonic() + lease_s)
        self._wake.set()

    def _p_holds(self, ep: Endpoint, now: float) -> None:
        """Hold every pending send a D rank asked for, on that D engine's link."""
        if not self._sends:
            return
        for (kind, rid), agents in ep.pending_notifications().items():
            s = self._sends.get(rid)
            if kind not in ("req", "read") or s is None or s.closing or s.hold is not None:
                continue
            engine = next((self._agent_engine[a] for a in sorted(agents) if a in self._agent_engine), None)
            if engine is None:
                continue
            link = self._p_links[engine]
            offer = self._offers.get(rid)
            try:
                if offer is not None and offer.link is link:  # a packed pull: pack what D planned
                    s.hold = link.serve_pull(rid, plan=offer.plan, timeout_s=max(s.expiry - now, 0.5))
                else:
                    s.hold = link.hold(rid, timeout_s=max(s.expiry - now, 0.5))
            except ExecutorError as e:
                self.log.warning("kvgeom connector: cannot hold %s for D engine %s: %s", rid, engine, e)

    def _p_frees(self, server: SideChannelServer, now: float) -> None:
        """Free (report) a pending send once D released it and its hold is over, or its lease passed.

        A release for a request already freed (D released it after the lease expired or after
        D's failed pull ended the hold) is dropped, not kept for the side channel's hour."""
        if server.pending():
            server.forget_if(lambda rid: rid in self._seen and rid not in self._sends)
        if self._offers and now - self._offers_pruned > 1.0:
            self._prune_offers(now)
            self._offers_pruned = now
        for rid, s in list(self._sends.items()):
            if not s.closing:
                t = s.hold
                if isinstance(t, PackedTransfer) and not t.settled:
                    # a D rank of the packed plan released without asking (it failed before posting):
                    # the chunks it reads would wait for its req until the others' timeout; end now
                    gone = (server.released_ranks(rid) & {d for ch in t.chunks for d in ch.peers}) - t.asked
                    if gone:
                        t.cancel("aborted", f"D rank(s) {sorted(gone)} released {rid!r:.80} without pulling it")
                if server.released(rid):
                    s.closing = "released"
                elif now > s.expiry:
                    s.closing = "lease expired"
                    self.log.warning("kvgeom connector: the lease of %s expired before D released it", rid)
                elif s.hold is not None and s.hold.settled and s.hold.failure is not None:
                    s.closing = "hold ended"
            if not s.closing:
                continue
            t = s.hold
            if t is not None and not t.settled:
                t.cancel("aborted", f"P frees the request ({s.closing})")
            if t is None or t.fenced:
                self.log.debug("kvgeom connector: %s freed (%s)", rid, s.closing)
                del self._sends[rid]
                self._offers.pop(rid, None)
                self.outcomes[f"freed {s.closing}"] += 1
                server.forget(rid)
                self._out.finished_sending.add(rid)


    # ---- P: a D rank's packed offer (side-channel threads) ---------------------------------
    def _on_packed(self, offer: PackedOffer) -> None:
        """Accept ``offer`` once this rank planned the same packed plan (:mod:`.packed_pulls`);
        raises :class:`SideChannelError` to refuse it (D's pull then fails before posting). The
        MAC is checked before anything else of the offer is looked at."""
        with self.lock:
            link = self._p_links.get(offer.engine)
            if self.prefill is None or link is None:
                raise SideChannelError("packed.engine", f"P rank {self.rank} has no link with D engine "
                                       f"{offer.engine!r:.80}", fix="handshake before offering a packed pull")
            budget = self.prefill.budget
        check_offer(link, offer, self.lock)
        with self.lock:
            have = self._offers.get(offer.request)
            if have is not None and have.link is link and have.digest == offer.digest:
                return  # (another D rank of the same pull, or a retry)
            self._check_servable(offer.request)
        planned = plan_offer(link, offer, budget)
        with self.lock:
            self._check_servable(offer.request)  # (again: the send may have been freed or held meanwhile)
            have = self._offers.get(offer.request)
            if have is not None and not (have.link is link and have.digest == planned.digest):
                raise SideChannelError("packed.request", f"{offer.request!r:.80} was offered with another plan",
                                       actual=planned.digest, expected=have.digest)
            self._prune_offers(time.monotonic())
            if have is None and len(self._offers) >= MAX_OFFERS:
                raise SideChannelError("packed", f"{MAX_OFFERS} packed offers kept, refusing more")
            if self._offers.setdefault(offer.request, planned) is planned:
                self.outcomes["packed offers accepted"] += 1
        self.log.debug("kvgeom connector: packed offer for %s from D engine %s rank %d accepted", offer.request,
                       offer.engine, offer.d_rank)

    def _check_servable(self, rid: str) -> None:
        """(Under the lock.) Refuse an offer for a request P freed, or already serves without one."""
        if rid in self._seen and rid not in self._sends:
            raise SideChannelError("packed.request", f"P freed {rid!r:.80} already")
        s = self._sends.get(rid)
        if s is not None and s.hold is not None and rid not in self._offers:
            raise SideChannelError("packed.request", f"P holds {rid!r:.80} for a direct pull already")

    def _prune_offers(self, now: float) -> None:
        """(Under the lock.) Forget offers past :data:`OFFER_TTL_S` whose send never came, and offers
        of links no longer in use (a D engine that re-handshook)."""
        links = set(map(id, self._p_links.values()))
        for rid in [r for r, o in self._offers.items()
                    if r not in self._sends and (now - o.arrived > OFFER_TTL_S or id(o.link) not in links)]:
            del self._offers[rid]

    # ---- P: a D engine's handshake (side-channel threads) ----------------------------------
    def _on_handshake(self, engine: str, rank: int, tp: int, payload: bytes) -> None:
        """Collect D engine ``engine``'s payloads; connect once all ``tp`` arrived; return once linked."""
        self.log.debug("kvgeom connector: handshake from D engine %s rank %d of %d", engine, rank, tp)
        digest = hashlib.sha256(payload).digest()
        deadline = time.monotonic() + self.handshake_timeout_s
        connect = False
        with self._hs_cond:
            self._hs_prune()
            c = self._hs.get(engine)
            if c is None or c.tp != tp or c.digests.get(rank, digest) != digest or c.state == "failed":
                if c is None and sum(x.state != "linked" for x in self._hs.values()) >= MAX_COLLECTING:
                    raise SideChannelError("handshake", f"{MAX_COLLECTING} D engines are handshaking already")
                c = self._hs[engine] = _Collect(tp, time.monotonic())
            c.digests[rank] = digest
            if c.state == "linked":
                return
            c.payloads[rank] = payload
            if c.state == "collecting" and len(c.payloads) == tp:
                c.state, connect = "connecting", True
        if connect:
            self._connect_d_engine(engine, c)
        with self._hs_cond:
            while c.state not in ("linked", "failed"):
                left = deadline - time.monotonic()
                if left <= 0:
                    raise SideChannelError("handshake", f"D engine {engine!r:.80}: {len(c.payloads)} of {tp} ranks "
                                           f"handshook in {self.handshake_timeout_s:.0f} s")
                self._hs_cond.wait(min(left, 1.0))
            if c.state == "failed":
                raise SideChannelError("handshake", f"P rank {self.rank} refused D engine {engine!r:.80}: {c.error}")

    def _connect_d_engine(self, engine: str, c: _Collect) -> None:
        state, error = "linked", ""
        try:
            if self.prefill is None:
                raise ExecutorError("kv_role", "a handshake on an instance without a prefill endpoint")
            with self.lock:
                old = self._p_links.pop(engine, None)
                if old is not None:  # the D engine restarted with new agents
                    for info in old.peers.values():
                        self._agent_engine.pop(info.agent, None)
                    old.close()
            link = self._connect_link(self.prefill, [c.payloads[r] for r in range(c.tp)])
            with self.lock:
                self._p_links[engine] = link
                for info in link.peers.values():
                    self._agent_engine[info.agent] = engine
        except Exception as e:  # noqa: BLE001 - refused geometry, bad payload, NIXL: the D engine hears why
            state, error = "failed", f"{type(e).__name__}: {e}"[:400]
            self.log.error("kvgeom connector: handshake of D engine %s refused: %s", engine, error)
        self.log.debug("kvgeom connector: D engine %s %s", engine, state)
        with self._hs_cond:
            c.state, c.error = state, error
            c.payloads.clear()  # the link holds what it needs; only the digests stay (to spot a restart)
            self._hs_cond.notify_all()

    def _hs_prune(self) -> None:
        """Forget collections that never completed (their waiters have given up)."""
        cutoff = time.monotonic() - 2 * self.handshake_timeout_s
        for engine in [e for e, c in self._hs.items() if c.state in ("collecting", "failed") and c.started < cutoff]:
            del self._hs[engine]
