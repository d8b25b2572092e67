"""One endpoint's inbox: verify every arrived message and hand it to the attempt it names (docs/design.md §8.1, §14).

    agent.drain() -> [(sender, bytes)]
      sender not a connected peer (no link key) -------------> dropped, counted (unknown_sender)
      longer than MAX_MESSAGE, malformed, bad MAC -----------> dropped, counted (rejected)
      names a live or fencing attempt (its nonce) -----------> attempt.on_message (O(1) state update)
      P: a D rank's "req" (or an eager READ's "read") -------> kept: one per (request id, sender),
         before P's attempt is posted
                                                               at most inbox_max, for inbox_ttl_s
      "cancel" of an attempt this rank no longer has --------> answered "ended" (nothing in flight)
      P: "pulled" or "read" of an attempt that is over ------> answered "cancel" (D must not call it done)
      anything else (late, replayed, another attempt's) -----> dropped, counted (stale)

Nothing but those ``req`` entries is stored for a request no attempt waits for, so the inbox holds
at most ``inbox_max`` x (an id of at most 256 characters + one message of at most 512 bytes): about
4 MB at the default 4096 entries, whatever a peer floods (plus at most 4096 cancelled attempts and
4096 tombstones); each ``route`` costs O(messages that arrived) plus the entries
it evicts (oldest first, kept in arrival order).

Worked number: a D rank that pulls ``r1`` before P posts ``serve_pull("r1")`` leaves one entry
``("r1", <D agent>)`` here; the serve takes it when it is posted and answers ``grant``.
"""

from __future__ import annotations

import logging
import time
from collections import Counter, OrderedDict
from collections.abc import Callable
from typing import Any

from .protocol import Message, decode

__all__ = ["Inbox", "INBOX_TTL_S", "INBOX_MAX"]

logger = logging.getLogger(__name__)

INBOX_TTL_S = 300.0  # a D rank's req no attempt took is evicted after this
INBOX_MAX = 4096  # such reqs kept at most (the oldest evicted first)
TOMB_S = 30.0  # how long a failed P attempt answers the reqs of D ranks it never heard from with "cancel"
_CANCELLED_MAX = 4096  # (sender, D nonce) of reqs cancelled before they were taken

Reply = Callable[[str, str, str, int, int], None]  # (agent, kind, request id, D nonce, P nonce)


class Inbox:
    """The routing table of one endpoint: link keys per peer agent, attempts by nonce and by id."""

    def __init__(self, name: str, role: str, ttl_s: float = INBOX_TTL_S, max_entries: int = INBOX_MAX) -> None:
        self.name = name
        self.on_decode = role == "decode"
        self.ttl_s = ttl_s
        self.max_entries = max_entries
        self.keys: dict[str, bytes] = {}  # peer agent -> link key
        self.by_nonce: dict[int, Any] = {}  # this rank's attempts (live and fencing) by their nonce
        self.by_id: dict[str, Any] = {}  # live attempts by request id (one per id and endpoint)
        self.pending: OrderedDict[tuple[str, str], tuple[float, Message]] = OrderedDict()
        self.cancelled: OrderedDict[tuple[str, int], None] = OrderedDict()
        self.tombs: OrderedDict[str, tuple[float, frozenset[str]]] = OrderedDict()  # P: failed ids, for a while
        self.counts: Counter[str] = Counter()

    # ---- attempts --------------------------------------------------------------------------
    def add(self, t: Any) -> None:
        """Register a live attempt; a P attempt takes the reqs that arrived for its id before it."""
        self.by_nonce[t.nonce] = t
        self.by_id[t.request_id] = t
        if not self.on_decode:
            for agent in list(t.peers):
                entry = self.pending.pop((t.request_id, agent), None)
                if entry is not None:
                    t.on_message(entry[1])

    def settle(self, t: Any) -> None:
        """``t`` settled: its id may be used again (its nonce still routes, until :meth:`forget`). A
        failed P attempt leaves a tombstone for :data:`TOMB_S`: the req of a D rank it never heard from
        (P failed before D's attempt reached it; the others had its ``cancel``) that arrives meanwhile
        is answered ``cancel``, not kept, so that D fails at once instead of at its deadline."""
        if self.by_id.get(t.request_id) == t:  # (identity: transfers have no __eq__)
            del self.by_id[t.request_id]
            unheard = frozenset(set(t.peers) - t.contacted)
            if not self.on_decode and t.failure is not None and unheard:
                self.tombs[t.request_id] = (time.monotonic() + TOMB_S, unheard)
                self.tombs.move_to_end(t.request_id)
                while len(self.tombs) > _CANCELLED_MAX:
                    self.tombs.popitem(last=False)

    def forget(self, t: Any) -> None:
        """``t`` is fenced: nothing routes to it any more."""
        self.settle(t)
        if self.by_nonce.get(t.nonce) == t:
            del self.by_nonce[t.nonce]

    # ---- routing ---------------------------------------------------------------------------
    def route(self, arrived: list[tuple[str, bytes]], reply: Reply) -> None:
        """Verify and deliver every arrived message (see the module docstring), then evict."""
        now = time.monotonic()
        for sender, raw in arrived:
            key = self.keys.get(sender)
            if key is None:
                self.counts["unknown_sender"] += 1
                continue
            m = decode(raw, sender, self.name, key)
            if m is None:
                self.counts["rejected"] += 1
                continue
            self.counts["accepted"] += 1
            if m.kind != "ping":
                self._route(m, reply, now)
        self._evict(now)

    def _route(self, m: Message, reply: Reply, now: float) -> None:
        if self.on_decode:
            t = self.by_nonce.get(m.d_nonce)
            if t is not None:
                t.on_message(m)
            elif m.kind == "cancel":
                reply(m.sender, "ended", m.request_id, m.d_nonce, m.p_nonce)
            else:
                self.counts["stale"] += 1
            return
        if m.p_nonce == 0:  # D does not know P's attempt yet: its req or eager read, or its cancel before either
            t = self.by_id.get(m.request_id)
            if t is not None and m.sender in t.peers and t.peer_nonce.get(m.sender, m.d_nonce) == m.d_nonce:
                t.on_message(m)  # (a req of another D attempt waits for P's next attempt of the id)
            elif m.kind in ("req", "read"):
                if (m.sender, m.d_nonce) in self.cancelled:
                    self.counts["stale"] += 1
                    return
                tomb = self.tombs.get(m.request_id)
                if tomb is not None and now < tomb[0] and m.sender in tomb[1]:
                    self.counts["refused"] += 1
                    reply(m.sender, "cancel", m.request_id, m.d_nonce, 0)
                    return
                key = (m.request_id, m.sender)
                self.pending[key] = (now, m)
                self.pending.move_to_end(key)
                self.counts["kept"] += 1
            elif m.kind == "cancel":
                entry = self.pending.get((m.request_id, m.sender))
                if entry is not None and entry[1].d_nonce == m.d_nonce:
                    del self.pending[(m.request_id, m.sender)]
                self.cancelled[(m.sender, m.d_nonce)] = None
                while len(self.cancelled) > _CANCELLED_MAX:
                    self.cancelled.popitem(last=False)
                reply(m.sender, "ended", m.request_id, m.d_nonce, 0)
            else:
                self.counts["stale"] += 1
            return
        t = self.by_nonce.get(m.p_nonce)
        if t is not None:
            t.on_message(m)
        elif m.kind == "cancel":
            reply(m.sender, "ended", m.request_id, m.d_nonce, m.p_nonce)
        elif m.kind in ("pulled", "read"):
            self.counts["late_read"] += 1
            reply(m.sender, "cancel", m.request_id, m.d_nonce, m.p_nonce)
        else:
            self.counts["stale"] += 1

    def _evict(self, now: float) -> None:
        """Drop kept reqs older than ``ttl_s``, then the oldest beyond ``max_entries``."""
        evicted = 0
        while self.pending:
            key, (arrived, _) = next(iter(self.pending.items()))
            if now - arrived <= self.ttl_s and len(self.pending) <= self.max_entries:
                break
            del self.pending[key]
            evicted += 1
        if evicted:
            self.counts["evicted"] += evicted
            logger.warning("%s: evicted %d request(s) no transfer took (older than %.0f s or beyond %d entries)",
                           self.name, evicted, self.ttl_s, self.max_entries)

    def pending_ids(self) -> dict[tuple[str, str], set[str]]:
        """Kept messages: (kind, request id) -> sender agents (kind ``req``, or ``read`` for an eager READ's)."""
        out: dict[tuple[str, str], set[str]] = {}
        for (rid, sender), (_, m) in self.pending.items():
            out.setdefault((m.kind, rid), set()).add(sender)
        return out

    def nbytes(self) -> int:
        """An upper bound of the bytes the kept entries hold (ids, senders, one message each)."""
        tombs = sum(2 * len(rid) + 100 + sum(2 * len(a) + 60 for a in agents) for rid, (_, agents) in self.tombs.items())
        return sum(2 * (len(rid) + len(sender)) + 400 for rid, sender in self.pending) + 64 * len(self.cancelled) + tombs

    def clear(self) -> None:
        self.pending.clear()
        self.cancelled.clear()
        self.tombs.clear()
        self.by_nonce.clear()
        self.by_id.clear()
        self.keys.clear()
