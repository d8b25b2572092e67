"""The connector's executor: one worker rank's endpoints, links, threads and lock (docs/design.md §15.4).

Every call the connector makes into kvgeom_nixl (:class:`~kvgeom_nixl.Endpoint`,
:class:`~kvgeom_nixl.Link`) is in this module and its two parts: D's pull jobs
(:mod:`kvgeom_nixl.vllm.pulls`) and P's pending sends and holds (:mod:`kvgeom_nixl.vllm.holds`).
The engine's thread only queues work and takes
results (:meth:`ConnectorExecutor.pull`, :meth:`release`, :meth:`send`, :meth:`take`); NIXL
progress never waits for an engine step:

    engine thread        start_load_kv -> pull / release / send      get_finished -> take()
                                  |  (queues, one lock)                          ^
    progress thread      every 0.5 ms while a transfer or hold is in flight, 2 ms while other work is
                         pending (50 ms idle), under the lock:
                         decode/prefill .get_finished() -> results; P: hold on D's req, free on release
    jobs thread          D: side-channel handshake (no lock) -> connect, plan, link.pull (lock);
                         a shape seen before: its recipe, link.post_pull (lock), no planning;
                         a packed plan: its offer to P first (side channel, no lock, .packed_pulls)
    releases thread      D: releases to P over the side channel (no lock; apart from the jobs so
                         that a P that never answers delays no pull)
    side-channel threads P: a D engine's handshake -> prefill.connect (lock) once all its ranks arrived;
                         a D rank's packed offer -> checked (lock), planned (no lock), kept (lock)

Both endpoints share :attr:`ConnectorExecutor.lock` (one ``RLock`` per worker rank, passed as
``Endpoint(..., lock=)``, docs/design.md §8.2), and the executor's own state is guarded by it too,
so every call into an endpoint, a link or a transfer and every read of that state holds one lock
(no lock order to get wrong); network
waits (side channel), probing a peer's NIXL metadata (:func:`probed`) and planning happen outside
it, so the engine's thread never waits for them (a vLLM worker is pinned to one core shared with
other busy threads: starting the prober process alone can take seconds there).

One attempt per request. D pulls with the id P gave its request (``remote_request_id``), so P can
tell which of its pending sends a D rank's ``req`` asks for: the progress thread finds the id
among :meth:`~kvgeom_nixl.Endpoint.pending_notifications`, and holds it (``link.hold``, P knows
only its own blocks; ``link.serve_pull`` with the plan of D's offer for a packed pull) on the link of
the D engine that asked, for what is left of its lease. P frees
a request (``finished_sending``) once every D rank released it over the side channel and its hold
is over, or when its lease expires (a live hold is then cancelled: a READ still in flight gets
``cancel``, so D fails that pull and recomputes, docs/design.md §8.1).

kv_both: an :class:`~kvgeom_nixl.Endpoint` has one role, so an instance that both serves and pulls
registers its layer tensors with two endpoints (two NIXL agents), one ``prefill``, one ``decode``.
"""

from __future__ import annotations

import collections
import logging
import queue
import threading
import time
from collections.abc import Sequence
from typing import Any

from kvgeom import EngineGeometry, LayerTensors
from kvgeom_nixl.endpoint import Endpoint, Link
from kvgeom_nixl.errors import HandshakeError
from kvgeom_nixl.handshake import HandshakeLimits, RankInfo, decode_rank
from kvgeom_nixl.probe import ProbeRefused, ProberUnavailable, prober

from .holds import MAX_COLLECTING, MAX_SEEN, HoldSide, _Collect, _Send
from .packed_pulls import PlannedOffer
from .pulls import (
    DEFAULT_PULL_TIMEOUT_S,
    PACKED_SETUP_S,
    STRATEGY,
    PullJob,
    PullSide,
    ReleaseJob,
    Results,
    connector_costs,
    whole_pages,
)
from .recipes import PullRecipes
from .side_channel import SideChannelServer

__all__ = ["ConnectorExecutor", "PullJob", "ReleaseJob", "Results", "local_executor", "whole_pages", "STRATEGY",
           "DEFAULT_PULL_TIMEOUT_S", "PACKED_SETUP_S", "DEFAULT_HANDSHAKE_TIMEOUT_S", "MAX_COLLECTING", "MAX_SEEN"]

DEFAULT_HANDSHAKE_TIMEOUT_S = 120.0
FAST_POLL_S = 0.0005  # progress interval while a transfer or a hold is in flight (each protocol step waits a tick)
BUSY_POLL_S = 0.002  # ... while only pulls being posted or pending sends (waiting for D's req) exist
IDLE_POLL_S = 0.05
_LOCAL: dict[str, ConnectorExecutor] = {}  # engine id -> the executor of a worker in this process
_LOCAL_LOCK = threading.Lock()


def local_executor(engine_id: str) -> ConnectorExecutor | None:
    """The executor of engine ``engine_id``'s worker when it runs in this process (vLLM's
    single-process engine, ``VLLM_ENABLE_V1_MULTIPROCESSING=0``, or a uni executor in the engine
    core): the scheduler then hands P's pending sends to it at once, because such an engine steps
    only while a caller waits for outputs, and a hold must not wait for the next call."""
    with _LOCAL_LOCK:
        return _LOCAL.get(engine_id)


def probed(payloads: Sequence[bytes], limits: HandshakeLimits) -> list[RankInfo]:
    """The peer ranks' payloads decoded, and each one's NIXL metadata loaded and unloaded in the
    process's prober first (what ``Endpoint.connect`` does with ``probe=True``, done here outside
    the executor's lock so that ``connect(..., probe=False)`` under it is quick). Raises
    :class:`~kvgeom_nixl.errors.HandshakeError` for a payload refused or a blob NIXL refuses."""
    if len(payloads) > limits.max_ranks:
        raise HandshakeError("payloads", f"{len(payloads)} peer payloads, beyond {limits.max_ranks} ranks",
                             actual=len(payloads), expected=f"<= {limits.max_ranks}")
    infos = [decode_rank(p, limits=limits) for p in payloads]
    for info in infos:
        try:
            name = prober().probe(info.metadata)
        except ProbeRefused as e:
            raise HandshakeError(f"payloads[rank {info.rank}].nixl_metadata", f"NIXL refused the metadata: {e}",
                                 fix="send the metadata get_agent_metadata() made, unmodified") from None
        except ProberUnavailable as e:  # the endpoint's own in-process scratch agent probes instead
            raise _NoProber(str(e)) from None
        if name != info.agent:
            raise HandshakeError(f"payloads[rank {info.rank}].agent", f"the NIXL metadata is agent {name[:80]!r}, "
                                 f"the payload says {info.agent[:80]!r}", actual=name, expected=info.agent)
    return infos


class _NoProber(Exception):
    """No prober process could be started: connect probes itself (under the lock)."""


def _connect(ep: Endpoint, lock: Any, payloads: Sequence[bytes]) -> Link:
    """``ep.connect`` for peer ``payloads``: probed outside ``lock``, connected under it."""
    try:
        infos = probed(payloads, ep.limits)
    except _NoProber:
        with lock:
            return ep.connect(payloads)
    with lock:
        return ep.connect(infos, probe=False)




class ConnectorExecutor(PullSide, HoldSide):
    """One worker rank's executor (see the module docstring); ``close()`` stops its threads.

    D's pull jobs are :class:`~kvgeom_nixl.vllm.pulls.PullSide`'s, P's pending sends, holds and
    handshakes :class:`~kvgeom_nixl.vllm.holds.HoldSide`'s; this class owns their state, the lock,
    the endpoints and the threads. ``recipes=False`` plans every pull (no per-shape recipes,
    :mod:`kvgeom_nixl.vllm.recipes`); ``eager=True`` READs at once instead of asking P (``req``)
    and waiting for its grant (``Link.pull(..., eager=True)``; the trade: docs/design.md §15.4);
    ``packed_setup_s`` is what auto adds to a packed pull's cost (:func:`~.pulls.connector_costs`;
    0 packs wherever kvgeom's cost model alone says packing is cheaper)."""

    def __init__(self, engine: EngineGeometry, rank: int, tp: int, layers: Sequence[LayerTensors], *, engine_id: str,
                 producer: bool = True, consumer: bool = True, host: str = "127.0.0.1", port: int = 0,
                 staging_bytes: int = 0, pull_timeout_s: float = DEFAULT_PULL_TIMEOUT_S,
                 handshake_timeout_s: float = DEFAULT_HANDSHAKE_TIMEOUT_S, strategy: str = STRATEGY,
                 log: logging.Logger | None = None, recipes: bool = True, eager: bool = False,
                 packed_setup_s: float = PACKED_SETUP_S) -> None:
        self.log = log or logging.getLogger(__name__)
        self.cost_model = connector_costs(packed_setup_s)
        self.engine_id, self.rank, self.tp = engine_id, rank, tp
        self.pull_timeout_s, self.handshake_timeout_s, self.strategy = pull_timeout_s, handshake_timeout_s, strategy
        self.lock = threading.RLock()
        self.prefill = (Endpoint(engine, "prefill", rank, layers, staging_bytes=staging_bytes, lock=self.lock)
                        if producer else None)
        self.decode = (Endpoint(engine, "decode", rank, layers, staging_bytes=staging_bytes, lock=self.lock)
                       if consumer else None)
        self._d_payload = self.decode.handshake() if self.decode is not None else b""
        # D state: links by P engine (jobs thread), posted pulls by transfer id (under the lock)
        self._d_links: dict[str, Link] = {}
        self.recipes = recipes
        self.eager = eager
        self._d_recipes: dict[str, PullRecipes] = {}  # by P engine: the recipes learnt on its current link
        self._pulls: dict[str, PullJob] = {}
        # P state (under the lock): links by D engine, D agent -> engine, pending sends
        self._p_links: dict[str, Link] = {}
        self._agent_engine: dict[str, str] = {}
        self._sends: dict[str, _Send] = {}
        self._seen: dict[str, None] = {}  # every send registered, oldest first (at most MAX_SEEN)
        self._hs: dict[str, _Collect] = {}
        self._hs_cond = threading.Condition()
        self._offers: dict[str, PlannedOffer] = {}  # P: packed offers by P request id (.packed_pulls)
        self._offers_pruned = 0.0
        self._out = Results()
        self.outcomes: collections.Counter[str] = collections.Counter()  # see counters()
        self._jobs: queue.Queue[PullJob | None] = queue.Queue()
        self._releases: queue.Queue[ReleaseJob | None] = queue.Queue()  # their own thread: a hung P delays no pull
        self._stop = threading.Event()
        self._wake = threading.Event()
        self.server: SideChannelServer | None = None
        if self.prefill is not None:
            self.server = SideChannelServer(host, port, self.prefill.handshake(), self._on_handshake, self._on_packed)
        self._threads = [threading.Thread(target=self._progress_loop, name=f"kvgeom-progress-{rank}", daemon=True),
                         threading.Thread(target=self._jobs_loop, name=f"kvgeom-jobs-{rank}", daemon=True),
                         threading.Thread(target=self._releases_loop, name=f"kvgeom-releases-{rank}", daemon=True)]
        for t in self._threads:
            t.start()
        with _LOCAL_LOCK:
            _LOCAL[engine_id] = self

    # ---- the engine thread's calls ---------------------------------------------------------
    def take(self) -> Results:
        """Everything that ended since the last call (each id reported once)."""
        with self.lock:
            out, self._out = self._out, Results()
        return out

    def pending(self) -> dict[str, int]:
        """Counts, for tests and logs: posted pulls, pending sends, P and D links, release entries."""
        with self.lock:
            return {"pulls": len(self._pulls), "sends": len(self._sends), "offers": len(self._offers),
                    "p_links": len(self._p_links),
                    "d_links": len(self._d_links), "releases": self.server.pending() if self.server else 0,
                    "jobs": self._jobs.qsize() + self._releases.qsize()}

    def counters(self) -> dict[str, int]:
        """What this rank holds for requests, and what it did, for leak checks and logs.

        :meth:`pending`'s counts, plus ``holds`` (pending sends a D rank is reading), ``in_flight``
        and ``fencing`` (transfers of both endpoints), ``staging_busy`` / ``staging_waiting``
        (slots owned, chunks queued for one), ``inbox`` (kept ``req`` messages and attempts
        routed by id or nonce), ``unreported`` (results :meth:`take` has not handed out yet): all
        0 on an idle rank. ``inbox_tombs`` and ``inbox_cancelled`` are bounded by time and size
        (not leaks). Then the running totals (never reset): ``freed released``, ``freed lease
        expired``, ``freed hold ended`` (P), ``pull done``, ``pull failed <reason>``, and ``recipes
        applied`` / ``learnt`` / ``refused`` / ``seen`` (D, :mod:`kvgeom_nixl.vllm.recipes`)."""
        with self.lock:
            eps = [e for e in (self.prefill, self.decode) if e is not None]
            rings = [e.staging for e in eps if e.staging is not None]
            out = dict(self.pending())
            out.update({
                "holds": sum(s.hold is not None for s in self._sends.values()),
                "in_flight": sum(len(e.in_flight) for e in eps),
                "fencing": sum(len(e.fencing) for e in eps),
                "staging_busy": sum(r.slots - r.free() for r in rings),
                "staging_waiting": sum(len(r.waiting) for r in rings),
                "inbox": sum(len(e.inbox.pending) + len(e.inbox.by_id) + len(e.inbox.by_nonce) for e in eps),
                "unreported": len(self._out.finished_sending) + len(self._out.finished_recving) + len(self._out.failed),
                "inbox_tombs": sum(len(e.inbox.tombs) for e in eps),
                "inbox_cancelled": sum(len(e.inbox.cancelled) for e in eps),
            })
            out.update(self.outcomes)
            for book in list(self._d_recipes.values()):  # (the jobs thread's: copied whole, under the GIL)
                for what, n in dict(book.counts).items():
                    out[f"recipes {what}"] = out.get(f"recipes {what}", 0) + n
            return out

    def _connect_link(self, ep: Endpoint, payloads: list[bytes]) -> Link:
        return _connect(ep, self.lock, payloads)

    # ---- progress thread -------------------------------------------------------------------
    def _progress_loop(self) -> None:
        while not self._stop.is_set():
            try:
                interval = self._tick()
            except Exception:  # noqa: BLE001 - never let the thread die silently: log, back off, go on
                self.log.exception("kvgeom connector: progress failed")
                interval = IDLE_POLL_S
            self._wake.wait(interval)
            self._wake.clear()

    def _tick(self) -> float:
        """One progress pass; returns how long to wait before the next. A pull is a few protocol
        steps (req, grant, READ, pulled, held), each one tick of one side's thread: while one is in
        flight the thread polls every ``FAST_POLL_S``."""
        with self.lock:
            now = time.monotonic()
            if self.decode is not None:
                self._d_finished(self.decode)
            if self.prefill is not None and self.server is not None:
                self.prefill.get_finished()  # (holds are watched through their transfers below)
                self._p_holds(self.prefill, now)
                self._p_frees(self.server, now)
            if (self.decode is not None and self.decode.in_flight) or (self.prefill is not None
                                                                       and self.prefill.in_flight):
                return FAST_POLL_S
            busy = self._pulls or self._sends or (self.prefill is not None and self.prefill.fencing)
            return BUSY_POLL_S if busy else IDLE_POLL_S

    # ---- teardown --------------------------------------------------------------------------
    def close(self) -> None:
        with _LOCAL_LOCK:
            if _LOCAL.get(self.engine_id) is self:
                del _LOCAL[self.engine_id]
        self._stop.set()
        self._wake.set()
        self._jobs.put(None)
        self._releases.put(None)
        for t in self._threads:
            t.join(timeout=5.0)
        if self.server is not None:
            self.server.close()
        with self.lock:
            for link in [*self._d_links.values(), *self._p_links.values()]:
                link.close()
            self._d_links.clear()
            self._p_links.clear()
            for ep in (self.decode, self.prefill):
                if ep is not None:
                    ep.close()

