"""P's side of the connector's executor: pending sends, holds and frees, D engines' handshakes
(docs/design.md §15.4).

vLLM hands P's finished requests over as pending sends (:meth:`HoldSide.send`, with a lease). The
progress thread holds each one on the link of the D engine whose rank asked for it (``req``, or
the ``read`` of D's eager READ; ``link.hold``: P knows only its own blocks), and frees it (``finished_sending``) once every D rank
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
from kvgeom_nixl.transfer import Transfer

from .pulls import Results
from .side_channel import SideChannelError, SideChannelServer

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
            try:
                s.hold = self._p_links[engine].hold(rid, timeout_s=max(s.expiry - now, 0.5))
            except ExecutorError as e:
                self.log.warning("kvgeom connector: cannot hold %s for D engine %s: %s", rid, engine, e)

    def _p_frees(self, server: SideChannelServer, now: float) -> None:
        """Free (report) a pending send once D released it and its hold is over, or its lease passed.

        A release for a request already freed (D released it after the lease expired or after
        D's failed pull ended the hold) is dropped, not kept for the side channel's hour."""
        if server.pending():
            server.forget_if(lambda rid: rid in self._seen and rid not in self._sends)
        for rid, s in list(self._sends.items()):
            if not s.closing:
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
                self.outcomes[f"freed {s.closing}"] += 1
                server.forget(rid)
                self._out.finished_sending.add(rid)


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
